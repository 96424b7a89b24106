"""Fine-tune the whole Stable Diffusion 1.x / 2.x (v-prediction too) model (sd-scripts compatible flags).

    accelerate launch fine_tune.py --pretrained_model_name_or_path MODEL --dataset_config data.toml \
        --output_dir out --output_name my_model --save_model_as safetensors --learning_rate 1e-5
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sd", "Fine-tune Stable Diffusion 1.x / 2.x (v-prediction too) (the model's own weights)", fine_tune=True))
