"""Write a tiny SD 1.x / 2.x / SDXL / FLUX.1 model (real architecture, toy widths, fixed seed) for tests and trials.

    python tools/make_tiny_model.py --family sd1 --out models/tiny-sd1
    python tools/make_tiny_model.py --family sd2-v --out models/tiny-sd2-v.safetensors --single_file
    python tools/make_tiny_model.py --family sdxl --out models/tiny-sdxl.safetensors --single_file
    python tools/make_tiny_model.py --family flux --out models/tiny-flux --single_file
    python tools/make_tiny_model.py --family sd3 --out models/tiny-sd3.safetensors --single_file
    python tools/make_tiny_model.py --family chroma --out models/tiny-chroma --single_file
    python tools/make_tiny_model.py --family anima --out models/tiny-anima --single_file
    python tools/make_tiny_model.py --family lumina --out models/tiny-lumina
    python tools/make_tiny_model.py --family hunyuan_image --out models/tiny-hunyuan

FLUX.1 with --single_file writes the BFL transformer (flux1-tiny.safetensors, or the
.safetensors name given) plus clip_l.safetensors, t5xxl.safetensors and ae.safetensors
next to it, as sd-scripts' --clip_l / --t5xxl / --ae take them. Chroma (single file only) writes
chroma-tiny.safetensors plus t5xxl.safetensors and ae.safetensors (flux_train_network.py --model_type chroma).
Anima is always written as its files
(--out is a folder): anima-tiny.safetensors (DiT + LLM adapter, `net.*`), qwen_3_06b_base.safetensors and
qwen_image_vae.safetensors (ComfyUI's names), as --qwen3 / --vae take them. SD3 with --single_file writes the
SAI all-in-one file (MMDiT, VAE, CLIP-L, CLIP-G, T5); with --separate_text_encoders the MMDiT + VAE
file plus clip_l / clip_g / t5xxl.safetensors next to it (for --clip_l / --clip_g / --t5xxl).
Lumina Image 2.0 is always written as its files (--out is a folder): lumina-tiny.safetensors (the original
NextDiT names), gemma_2_2b.safetensors (`model.*`) and ae.safetensors (BFL's names), for --gemma2 / --ae.
HunyuanImage 2.1 is always written as its files (--out is a folder): hunyuanimage2.1-tiny.safetensors (the original
DiT names), qwen_2.5_vl_7b.safetensors, byt5_small_glyphxl.safetensors and hunyuan_image_2.1_vae.safetensors, for
--text_encoder / --byt5 / --vae.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.core.errors import run_tool  # noqa: E402
from library.families import registered_families  # noqa: E402


def tiny_presets() -> dict[str, tuple[str, str]]:
    """--family choice -> (family name, preset): each family's `tiny_presets`, named after "tiny:"."""
    return {preset.removeprefix("tiny:"): (family.name, preset)
            for family in registered_families() for preset in family.tiny_presets}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=list(tiny_presets()), help="which tiny model to write")
    parser.add_argument("--out", required=True,
                        help="output: a folder (diffusers layout) or, with --single_file, a .safetensors/.ckpt file "
                             "(flux: a .safetensors name or a folder for the four files)")
    parser.add_argument("--single_file", action="store_true",
                        help="write one checkpoint file in the original LDM (SDXL: SGM) layout instead of a diffusers "
                             "folder; flux: the BFL transformer plus clip_l / t5xxl / ae files")
    parser.add_argument("--separate_text_encoders", action="store_true",
                        help="sd3 with --single_file: the text encoders as clip_l / clip_g / t5xxl files beside it")
    return parser


def write(args: argparse.Namespace) -> None:
    """Write the tiny model `args` names through its family's `write_preset` (UserError on a bad --out)."""
    from library.families import get_family

    name, preset = tiny_presets()[args.family]
    family = get_family(name)
    written = family.write_preset(preset, args.out, single_file=args.single_file,
                                  separate_text_encoders=args.separate_text_encoders)
    if written == {preset: args.out}:
        print(f"wrote {preset} to {args.out}")
        return
    for part, path in written.items():
        print(f"wrote {part}: {path}")
    hint = family.preset_hint(written)
    if hint:
        print(f"train with: {hint}")


def main(argv: list[str] | None = None) -> int:
    return run_tool(write, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
