"""Fine-tune the whole Lumina Image 2.0 DiT (sd-scripts compatible flags).

    accelerate launch lumina_train.py --pretrained_model_name_or_path lumina-image-2.safetensors \
        --gemma2 gemma-2-2b.safetensors --ae ae.safetensors --dataset_config data.toml \
        --output_dir out --output_name my_model --save_model_as safetensors --learning_rate 1e-5
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("lumina", "Fine-tune Lumina Image 2.0 (the DiT's own weights)", fine_tune=True))
