"""Train a LoRA for Stable Diffusion 1.x / 2.x (sd-scripts compatible flags).

    accelerate launch train_network.py --config_file examples/quickstart_sd.toml
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sd", "Train a LoRA / LyCORIS network on Stable Diffusion 1.x / 2.x"))
