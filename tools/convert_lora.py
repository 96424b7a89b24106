"""Convert a LoRA between the kohya, diffusers/PEFT, ai-toolkit (Flux) and ComfyUI (Anima) layouts; the source
layout is detected.

    python tools/convert_lora.py --src_path kohya.safetensors --dst_path peft.safetensors --to diffusers
    python tools/convert_lora.py --src_path ai_toolkit_flux.safetensors --dst_path kohya.safetensors --to kohya
    python tools/convert_lora.py --src_path anima_lora.safetensors --dst_path anima_comfy.safetensors --to comfy
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.families.lora_convert import LAYOUTS  # noqa: E402
from library.core.io_utils import clean_stale_temporaries_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src_path", required=True, help="input LoRA (.safetensors)")
    p.add_argument("--dst_path", required=True, help="output .safetensors")
    p.add_argument("--to", required=True, choices=list(LAYOUTS), help="layout to write")
    p.add_argument("--save_precision", choices=["float", "fp16", "bf16"], default=None,
                   help="dtype of the saved tensors (default: that of the input)")
    return p


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from library.core.metadata import save_lora_state_dict
    from library.families.lora_convert import convert, detect_layout
    from networks.lora_files import parse_precision, read_state_dict

    dtype = parse_precision(args.save_precision)
    state, metadata = read_state_dict(args.src_path)
    source_layout = detect_layout(state, args.src_path)
    out = convert(state, args.to, args.src_path)
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    md = {k: v for k, v in metadata.items() if not k.startswith("sshs_") and k != "modelspec.hash_sha256"}
    old = md.get("ss_training_comment")
    comment = f"converted from {source_layout} to {args.to} layout"
    md["ss_training_comment"] = f"{comment}; {old}" if old and old != "None" else comment
    clean_stale_temporaries_of(args.dst_path)
    save_lora_state_dict(args.dst_path, out, md)
    print(f"saved {args.dst_path}: {source_layout} -> {args.to}, {len(out)} tensors")


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
