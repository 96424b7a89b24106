"""Train a LoRA for FLUX.1 dev / schnell (sd-scripts compatible flags).

    accelerate launch flux_train_network.py --config_file my_flux_lora.toml
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("flux", "Train a LoRA network on FLUX.1 (rectified flow)"))
