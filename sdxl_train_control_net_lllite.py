"""ControlNet-LLLite for SDXL: small conditioning modules in front of the UNet's attention inputs, trained on
image / conditioning-image pairs with the UNet frozen (sd-scripts' sdxl_train_control_net_lllite.py flags;
docs/controlnet_lllite.md).

    accelerate launch sdxl_train_control_net_lllite.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors \
        --train_data_dir data --conditioning_data_dir cond --output_dir out --output_name my_lllite \
        --cond_emb_dim 32 --network_dim 64 --learning_rate 2e-4
"""

import sys

from library.cli.entry import run_training

if __name__ == "__main__":
    sys.exit(run_training("sdxl", "ControlNet-LLLite for SDXL (networks.control_net_lllite over a frozen UNet)",
                          lllite=True))
