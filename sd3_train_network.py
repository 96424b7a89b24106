"""Train a LoRA for SD3 / SD3.5 medium and large (sd-scripts compatible flags).

    accelerate launch sd3_train_network.py --config_file my_sd3_lora.toml
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("sd3", "Train a LoRA network on SD3 / SD3.5 (rectified flow)"))
