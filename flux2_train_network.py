"""Train a LoRA for FLUX.2 [klein] (musubi-tuner-style flags, sd-scripts compatible).

    accelerate launch flux2_train_network.py --pretrained_model_name_or_path flux-2-klein-base-4b.safetensors \
        --qwen3 qwen_3_4b.safetensors --ae flux2-vae.safetensors --dataset_config data.toml \
        --network_module networks.lora_flux2 --output_dir out --output_name my_lora
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("flux2", "Train a LoRA network on FLUX.2 klein (rectified flow)"))
