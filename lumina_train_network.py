"""Train a LoRA for Lumina Image 2.0 (sd-scripts compatible flags).

    accelerate launch lumina_train_network.py --config_file my_lumina_lora.toml
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("lumina", "Train a LoRA network on Lumina Image 2.0 (rectified flow)"))
