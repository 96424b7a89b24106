"""sd-scripts' gen_img.py: generate images with SD 1.x/2.x (SDXL with --sdxl), LoRA, img2img, inpainting, regional
prompts (AND) and the highres fix. An entry point of tools/generate.py, the one generator (docs/gen_img.md).

    python gen_img.py --ckpt model.safetensors --outdir out --prompt "a cat --n blurry --d 42" --steps 30 \
        --image_path start.png --strength 0.6
"""

import sys

from tools.generate import gen_img_main

if __name__ == "__main__":
    sys.exit(gen_img_main())
