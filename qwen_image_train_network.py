"""Train a LoRA for Qwen-Image (musubi-tuner compatible network module and defaults).

    accelerate launch qwen_image_train_network.py --config_file my_qwen_image_lora.toml
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("qwen_image", "Train a LoRA network on Qwen-Image (rectified flow)"))
