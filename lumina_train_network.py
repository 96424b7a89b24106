"""Train a LoRA for Lumina Image 2.0 (sd-scripts compatible flags).

    accelerate launch lumina_train_network.py --config_file my_lumina_lora.toml
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("lumina", "Train a LoRA network on Lumina Image 2.0 (rectified flow)"))
