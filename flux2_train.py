"""Fine-tune the whole FLUX.2 klein DiT (sd-scripts compatible flags); saves one DiT file in ComfyUI's names.

    accelerate launch flux2_train.py --pretrained_model_name_or_path flux-2-klein-base-4b.safetensors \
        --qwen3 qwen_3_4b.safetensors --ae flux2-vae.safetensors --dataset_config data.toml \
        --output_dir out --output_name my_model --save_model_as safetensors --learning_rate 1e-5
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("flux2", "Fine-tune FLUX.2 klein (the DiT's own weights)", fine_tune=True))
