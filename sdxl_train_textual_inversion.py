"""Textual inversion for SDXL: train the embedding of a new token in both text encoders, everything else frozen
(sd-scripts' sdxl_train_textual_inversion.py flags; docs/textual_inversion.md). The file holds clip_l and clip_g.

    accelerate launch sdxl_train_textual_inversion.py --pretrained_model_name_or_path MODEL --train_data_dir data \
        --output_dir out --token_string mychar4 --init_word girl --num_vectors_per_token 4 \
        --use_object_template --learning_rate 1e-6 --max_train_steps 1600
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sdxl", "Textual inversion for SDXL (the embedding of a new token in both text encoders)",
                          textual_inversion=True))
