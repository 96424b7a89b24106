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

from library.core.errors import UserError, run_tool  # noqa: E402

FAMILIES = {"sd1": "tiny:sd1", "sd2": "tiny:sd2", "sd2-v": "tiny:sd2-v", "sdxl": "tiny:sdxl", "flux": "tiny:flux",
            "chroma": "tiny:chroma", "anima": "tiny:anima", "sd3": "tiny:sd3",
            "lumina": "tiny:lumina", "hunyuan_image": "tiny:hunyuan_image"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=list(FAMILIES), help="which tiny model to write")
    parser.add_argument("--out", required=True,
                        help="output: a folder (diffusers layout) or, with --single_file, a .safetensors/.ckpt file "
                             "(flux: a .safetensors name or a folder for the four files)")
    parser.add_argument("--single_file", action="store_true",
                        help="write one checkpoint file in the original LDM (SDXL: SGM) layout instead of a diffusers "
                             "folder; flux: the BFL transformer plus clip_l / t5xxl / ae files")
    parser.add_argument("--separate_text_encoders", action="store_true",
                        help="sd3 with --single_file: the text encoders as clip_l / clip_g / t5xxl files beside it")
    return parser


def _write_sd3(out: str, single_file: bool, separate: bool) -> None:
    from library.families.sd3.saving import write_sd3_preset

    layout = "diffusers" if not single_file else "separate" if separate else "single_file"
    for name, path in write_sd3_preset(FAMILIES["sd3"], out, layout).items():
        print(f"wrote {name}: {path}")


def _write_flux(out: str, single_file: bool) -> None:
    from library.families.flux.saving import write_flux_preset

    written = write_flux_preset(FAMILIES["flux"], out, single_file=single_file)
    if not single_file:
        print(f"wrote tiny:flux to {out}")
        return
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    print("train with: --pretrained_model_name_or_path " + written["transformer"]
          + "".join(f" --{flag} {written[flag]}" for flag in ("clip_l", "t5xxl", "ae")))


def _write_chroma(out: str, single_file: bool) -> None:
    from library.families.chroma.model import write_chroma_preset

    if not single_file:
        raise UserError("--family chroma: add --single_file (Chroma is published as a single file; sd-scripts "
                        "loads no diffusers folder of it)")
    written = write_chroma_preset(FAMILIES["chroma"], out)
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    print("train with: flux_train_network.py --model_type chroma --apply_t5_attn_mask --guidance_scale 0 "
          f"--pretrained_model_name_or_path {written['transformer']} --t5xxl {written['t5xxl']} --ae {written['ae']}")


def _write_anima(out: str) -> None:
    from library.families.anima.loading import write_anima_preset

    if out.lower().endswith(".safetensors"):
        raise UserError(f"--out {out}: Anima is written as three files; expected a folder name")
    written = write_anima_preset(FAMILIES["anima"], out)
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    print(f"train with: --pretrained_model_name_or_path {written['dit']} --qwen3 {written['qwen3']} "
          f"--vae {written['vae']}")


def _write_lumina(out: str) -> None:
    from library.families.lumina.loading import write_lumina_preset

    if out.lower().endswith(".safetensors"):
        raise UserError(f"--out {out}: Lumina is written as three files; expected a folder name")
    written = write_lumina_preset(FAMILIES["lumina"], out)
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    print(f"train with: --pretrained_model_name_or_path {written['dit']} --gemma2 {written['gemma2']} "
          f"--ae {written['ae']}")


def _write_hunyuan_image(out: str) -> None:
    from library.families.hunyuan_image.loading import write_hunyuan_image_preset

    if out.lower().endswith(".safetensors"):
        raise UserError(f"--out {out}: HunyuanImage is written as four files; expected a folder name")
    written = write_hunyuan_image_preset(FAMILIES["hunyuan_image"], out)
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    print(f"train with: --pretrained_model_name_or_path {written['dit']} --text_encoder {written['text_encoder']} "
          f"--byt5 {written['byt5']} --vae {written['vae']}")


def write(args: argparse.Namespace) -> None:
    """Write the tiny model `args` names (UserError on a bad --out)."""
    from library.families.sd.saving import write_preset
    from library.families.sdxl.saving import write_sdxl_preset

    if args.family == "flux":
        _write_flux(args.out, args.single_file)
        return
    if args.family == "sd3":
        _write_sd3(args.out, args.single_file, args.separate_text_encoders)
        return
    if args.family == "chroma":
        _write_chroma(args.out, args.single_file)
        return
    if args.family == "anima":
        _write_anima(args.out)
        return
    if args.family == "lumina":
        _write_lumina(args.out)
        return
    if args.family == "hunyuan_image":
        _write_hunyuan_image(args.out)
        return
    if args.single_file and not args.out.lower().endswith((".safetensors", ".ckpt")):
        raise UserError(f"--out {args.out}: with --single_file expected a .safetensors or .ckpt file name")
    writer = {"sdxl": write_sdxl_preset}.get(args.family, write_preset)  # SDXL has its own SGM layout
    writer(FAMILIES[args.family], args.out, single_file=args.single_file)
    print(f"wrote {FAMILIES[args.family]} to {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_tool(write, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
