"""sd-scripts' sdxl_gen_img.py: gen_img.py for SDXL models (docs/gen_img.md); an entry point of tools/generate.py.

    python sdxl_gen_img.py --ckpt sdxl.safetensors --outdir out --prompt "a cat --w 1024 --h 1024" \
        --highres_fix_scale 0.5 --highres_fix_steps 20
"""

import sys

from tools.generate import gen_img_main

if __name__ == "__main__":
    sys.exit(gen_img_main(sdxl=True))
