"""Train a LoRA for FLUX.1 dev / schnell (sd-scripts compatible flags).

    accelerate launch flux_train_network.py --config_file my_flux_lora.toml
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("flux", "Train a LoRA network on FLUX.1 (rectified flow)"))
