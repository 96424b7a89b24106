"""Train a LoRA for Stable Diffusion XL (sd-scripts compatible flags).

    accelerate launch sdxl_train_network.py --config_file examples/quickstart_sdxl.toml
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sdxl", "Train a LoRA / LyCORIS network on Stable Diffusion XL"))
