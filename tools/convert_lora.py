"""Convert a LoRA between the kohya, diffusers/PEFT, ai-toolkit (Flux) and ComfyUI (Anima, HunyuanImage, Chroma, Lumina)
layouts; the source layout is detected.

    python tools/convert_lora.py --src_path kohya.safetensors --dst_path peft.safetensors --to diffusers
    python tools/convert_lora.py --src_path ai_toolkit_flux.safetensors --dst_path kohya.safetensors --to kohya
    python tools/convert_lora.py --src_path anima_lora.safetensors --dst_path anima_comfy.safetensors --to comfy
    python tools/convert_lora.py --src_path chroma_lora.safetensors --dst_path chroma_comfy.safetensors --to comfy
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.families.lora_convert import FAMILY_VERSIONS, LAYOUTS  # noqa: E402
from library.core.errors import ConfigError  # noqa: E402
from library.core.io_utils import clean_stale_temporaries_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src_path", required=True, help="input LoRA (.safetensors)")
    p.add_argument("--dst_path", required=True, help="output .safetensors")
    p.add_argument("--to", required=True, choices=list(LAYOUTS), help="layout to write")
    p.add_argument("--save_precision", choices=["float", "fp16", "bf16"], default=None,
                   help="dtype of the saved tensors (default: that of the input)")
    p.add_argument("--family", choices=sorted(FAMILY_VERSIONS), default=None,
                   help="the model family of a Lumina 2 or Z-Image LoRA whose metadata does not say (both have the "
                        "same module names); recorded as ss_base_model_version")
    p.add_argument("--new_rank", type=int, default=None,
                   help="a LyCORIS file (LoHa, LoKr, ...) for --to diffusers / ai-toolkit: re-factor each module to "
                        "a plain LoRA of this rank first (those layouts have no LyCORIS modules)")
    return p


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from library.core.metadata import save_lora_state_dict
    from library.families.lora_convert import convert, detect_layout
    from networks.lora_files import parse_precision, read_state_dict
    from networks.lycoris_delta import is_lycoris_state

    dtype = parse_precision(args.save_precision)
    state, metadata = read_state_dict(args.src_path)
    if args.family is not None:
        metadata = {**metadata, "ss_base_model_version": FAMILY_VERSIONS[args.family]}
    if state and is_lycoris_state(state):
        out, source_layout, metadata = _lycoris(args, state, metadata)
    else:
        if args.new_rank is not None:
            raise ConfigError("--new_rank: only for a LyCORIS file (LoHa, LoKr, ...); this file is a plain LoRA")
        source_layout = detect_layout(state, args.src_path)
        out = convert(state, args.to, args.src_path, metadata)
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    md = {k: v for k, v in metadata.items() if not k.startswith("sshs_") and k != "modelspec.hash_sha256"}
    old = md.get("ss_training_comment")
    comment = f"converted from {source_layout} to {args.to} layout"
    md["ss_training_comment"] = f"{comment}; {old}" if old and old != "None" else comment
    clean_stale_temporaries_of(args.dst_path)
    save_lora_state_dict(args.dst_path, out, md)
    print(f"saved {args.dst_path}: {source_layout} -> {args.to}, {len(out)} tensors")


def _lycoris(args, state, metadata):
    """(tensors, source layout, metadata) for a LyCORIS file: --to kohya / comfy keep its modules as they are
    (ComfyUI and A1111 load LyCORIS modules under kohya names); --to diffusers / ai-toolkit need --new_rank."""
    from library.families.lora_convert import convert
    from networks.lora_files import modules_state_dict
    from networks.lycoris_delta import as_lora_metadata, load_lycoris_file, refactored_lora

    if args.new_rank is None:
        if args.to in ("kohya", "comfy"):
            return dict(state), "lycoris", metadata
        raise ConfigError(f"--to {args.to}: {args.src_path} holds LyCORIS modules (LoHa, LoKr, ...), which the "
                          f"{args.to} layout has no keys for; give --new_rank R to re-factor them into a plain LoRA")
    if args.new_rank < 1:
        raise ConfigError(f"--new_rank: expected an integer >= 1, got {args.new_rank}")
    lora = load_lycoris_file(args.src_path, state, metadata)
    modules = [refactored_lora(m, args.new_rank) for m in lora.modules.values()]
    kohya = modules_state_dict(modules, lora.dtype)
    out = kohya if args.to == "kohya" else convert(kohya, args.to, args.src_path)
    return out, f"lycoris (re-factored to rank {args.new_rank})", as_lora_metadata(metadata)


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
