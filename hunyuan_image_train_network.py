"""Train a LoRA for HunyuanImage 2.1 (sd-scripts compatible flags).

    accelerate launch hunyuan_image_train_network.py --config_file my_hunyuan_image_lora.toml
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("hunyuan_image", "Train a LoRA network on HunyuanImage 2.1 (rectified flow)"))
