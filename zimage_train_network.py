"""Train a LoRA for Z-Image (Turbo / Base) (musubi-tuner's network module name, sd-scripts compatible flags).

    accelerate launch zimage_train_network.py --pretrained_model_name_or_path z_image_turbo_bf16.safetensors \
        --qwen3 qwen_3_4b.safetensors --ae ae.safetensors --dataset_config data.toml \
        --network_module networks.lora_zimage --output_dir out --output_name my_lora
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("zimage", "Train a LoRA network on Z-Image (rectified flow)"))
