"""Fine-tune the whole Anima DiT and its LLM adapter (sd-scripts compatible flags).

    accelerate launch anima_train.py --pretrained_model_name_or_path anima-preview.safetensors \
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --dataset_config data.toml \
        --output_dir out --output_name my_model --learning_rate 1e-5 --llm_adapter_lr 0
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("anima", "Fine-tune Anima (the DiT and its LLM adapter)", fine_tune=True))
