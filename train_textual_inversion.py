"""Textual inversion for Stable Diffusion 1.x / 2.x: train the embedding of a new token, everything else frozen
(sd-scripts' train_textual_inversion.py flags; docs/textual_inversion.md).

    accelerate launch train_textual_inversion.py --pretrained_model_name_or_path MODEL --train_data_dir data \
        --output_dir out --token_string mychar4 --init_word girl --num_vectors_per_token 4 \
        --use_object_template --learning_rate 1e-6 --max_train_steps 1600
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sd", "Textual inversion for Stable Diffusion 1.x / 2.x (the embedding of a new token)",
                          textual_inversion=True))
