"""DreamBooth: fine-tune the whole Stable Diffusion 1.x / 2.x model, text encoder included (sd-scripts' train_db.py
flags; docs/fine_tune.md "train_db.py").

    accelerate launch train_db.py --pretrained_model_name_or_path MODEL --train_data_dir data --reg_data_dir reg \
        --output_dir out --output_name my_model --learning_rate 1e-6 --stop_text_encoder_training 400
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sd", "DreamBooth fine-tune of Stable Diffusion 1.x / 2.x (the model's own weights, text "
                                "encoder included)", fine_tune=True, dreambooth=True))
