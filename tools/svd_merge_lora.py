"""Merge LoRAs with ratios into one LoRA of --new_rank: Σ ratio·ΔW re-factored by the fast SVD.

    python tools/svd_merge_lora.py --models a.safetensors b.safetensors --ratios 0.7 0.3 \
        --new_rank 32 --save_to merged.safetensors --save_precision fp16 \
        --lbws 1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1 0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1,1

--lbws takes one LoRA Block Weight list per model (networks/lora_block_weights.py).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", required=True, help="LoRA files to merge")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="one multiplier per model (default 1.0)")
    p.add_argument("--save_to", required=True, help="output .safetensors")
    p.add_argument("--new_rank", type=int, default=4, help="rank of the merged LoRA (default 4)")
    p.add_argument("--new_conv_rank", type=int, default=None, help="rank for 3x3 conv modules (default: --new_rank)")
    p.add_argument("--save_precision", choices=["float", "fp16", "bf16"], default=None,
                   help="dtype of the output (default: that of the first input)")
    p.add_argument("--precision", choices=["float", "fp16", "bf16"], default="float",
                   help="accepted for sd-scripts compatibility; merging always computes in float32")
    p.add_argument("--device", default="cpu", help="where to compute")
    p.add_argument("--lbws", nargs="*", default=None,
                   help="one LoRA Block Weight list per model, e.g. 1,0,0,0,0,0,0,1,1,1,1,1 (12 or 20 values for "
                        "SDXL, 17 or 26 for SD 1.x/2.x; the first, BASE, weights the text encoders)")
    return p


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from networks.lora_files import parse_precision
    from tools.merge_lora import merge_lora_files

    merge_lora_files(args.models, args.ratios, args.save_to, False, args.new_rank, args.new_conv_rank,
                     parse_precision(args.save_precision), args.device, lbws=args.lbws)


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
