"""Fine-tune the whole FLUX.1 model (sd-scripts compatible flags).

    accelerate launch flux_train.py --pretrained_model_name_or_path MODEL --dataset_config data.toml \
        --output_dir out --output_name my_model --save_model_as safetensors --learning_rate 1e-5
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("flux", "Fine-tune FLUX.1 (the model's own weights)", fine_tune=True))
