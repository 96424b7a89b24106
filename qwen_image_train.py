"""Fine-tune the whole Qwen-Image DiT (saved as one .safetensors in ComfyUI's names).

    accelerate launch qwen_image_train.py --pretrained_model_name_or_path qwen_image_bf16.safetensors \
        --text_encoder qwen_2.5_vl_7b.safetensors --vae qwen_image_vae.safetensors --dataset_config data.toml \
        --output_dir out --output_name my_model --save_model_as safetensors --learning_rate 1e-5
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("qwen_image", "Fine-tune Qwen-Image (the DiT's own weights)", fine_tune=True))
