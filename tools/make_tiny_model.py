"""Write a tiny SD 1.x / 2.x / SDXL model (real architecture, toy widths, fixed seed) for tests and trials.

    python tools/make_tiny_model.py --family sd1 --out models/tiny-sd1
    python tools/make_tiny_model.py --family sd2-v --out models/tiny-sd2-v.safetensors --single_file
    python tools/make_tiny_model.py --family sdxl --out models/tiny-sdxl.safetensors --single_file
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.errors import UserError  # noqa: E402

FAMILIES = {"sd1": "tiny:sd1", "sd2": "tiny:sd2", "sd2-v": "tiny:sd2-v", "sdxl": "tiny:sdxl"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=list(FAMILIES), help="which tiny model to write")
    parser.add_argument("--out", required=True,
                        help="output: a folder (diffusers layout) or, with --single_file, a .safetensors/.ckpt file")
    parser.add_argument("--single_file", action="store_true",
                        help="write one checkpoint file in the original LDM (SDXL: SGM) layout instead of a diffusers folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from library.families.sd_saving import write_preset
    from library.families.sdxl_saving import write_sdxl_preset

    try:
        if args.single_file and not args.out.lower().endswith((".safetensors", ".ckpt")):
            raise UserError(f"--out {args.out}: with --single_file expected a .safetensors or .ckpt file name")
        writer = {"sdxl": write_sdxl_preset}.get(args.family, write_preset)  # SDXL has its own SGM layout
        writer(FAMILIES[args.family], args.out, single_file=args.single_file)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {FAMILIES[args.family]} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
