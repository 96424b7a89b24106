"""Train a LoRA for HunyuanImage 2.1 (sd-scripts compatible flags).

    accelerate launch hunyuan_image_train_network.py --config_file my_hunyuan_image_lora.toml
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("hunyuan_image", "Train a LoRA network on HunyuanImage 2.1 (rectified flow)"))
