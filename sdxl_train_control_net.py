"""ControlNet for SDXL: a ControlNet trains on image / conditioning-image pairs, the model stays frozen (sd-scripts'
sdxl_train_control_net.py flags; docs/controlnet.md).

    accelerate launch sdxl_train_control_net.py --pretrained_model_name_or_path MODEL --train_data_dir data \
        --conditioning_data_dir cond --output_dir out --output_name my_controlnet --learning_rate 1e-5
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sdxl", "ControlNet for SDXL (the ControlNet trains, the model is frozen)", controlnet=True))
