"""Fine-tune the whole Anima DiT and its LLM adapter (sd-scripts compatible flags).

    accelerate launch anima_train.py --pretrained_model_name_or_path anima-preview.safetensors \
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --dataset_config data.toml \
        --output_dir out --output_name my_model --learning_rate 1e-5 --llm_adapter_lr 0
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("anima", "Fine-tune Anima (the DiT and its LLM adapter)", fine_tune=True))
