"""Train a LoRA for Anima (Cosmos-Predict2 DiT + LLM adapter + Qwen3, sd-scripts compatible flags).

    accelerate launch anima_train_network.py --pretrained_model_name_or_path anima-preview.safetensors \
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --dataset_config data.toml \
        --network_module networks.lora_anima --network_dim 16 --output_dir out --output_name my_lora
"""

from library.core import stop_signals

stop_signals.install_at_start()  # first: a stop signal during the imports below is kept (docs/resume.md)

import sys  # noqa: E402

from library.cli.entry import run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_training("anima", "Train a LoRA network on Anima (rectified flow)"))
