"""Train a LoRA for Stable Diffusion 1.x / 2.x (sd-scripts compatible flags).

    accelerate launch train_network.py --config_file examples/quickstart_sd.toml
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("sd", "Train a LoRA / LyCORIS network on Stable Diffusion 1.x / 2.x"))
