"""Cut a DyLoRA file into plain LoRAs of rank unit, 2·unit, ... (each written as <save_to>-NNNN.safetensors).

    python tools/extract_lora_from_dylora.py --model dylora.safetensors --save_to lora.safetensors --unit 4
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.core.errors import ConfigError  # noqa: E402
from library.core.io_utils import clean_stale_temporaries_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="DyLoRA file (networks.dylora, lora_down / lora_up layout)")
    p.add_argument("--save_to", required=True, help="base name of the outputs: <base>-<rank:04d><ext>")
    p.add_argument("--unit", type=int, required=True, help="rank step: files of rank unit, 2·unit, ... are written")
    return p


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from library.core.metadata import save_lora_state_dict
    from networks.dylora import split_ranks
    from networks.lora_files import read_state_dict

    if args.unit < 1:
        raise ConfigError(f"--unit: expected an integer >= 1, got {args.unit}")
    state, metadata = read_state_dict(args.model)
    downs = [v for k, v in state.items() if k.endswith(".lora_down.weight")]
    if not downs:
        raise ConfigError(f"--model {args.model}: no .lora_down.weight tensors; expected a DyLoRA file")
    max_rank = max(v.shape[0] for v in downs)
    if args.unit >= max_rank:
        raise ConfigError(f"--unit: expected a value below the file's rank {max_rank}, got {args.unit}")
    base, ext = os.path.splitext(args.save_to)
    comment = metadata.get("ss_training_comment", "")
    for rank, cut in split_ranks(state, args.unit):
        md = {k: v for k, v in metadata.items() if not k.startswith("sshs_") and k != "modelspec.hash_sha256"}
        md["ss_training_comment"] = f"split from DyLoRA, rank {max_rank} to {rank}; {comment}"
        md["ss_network_dim"] = str(rank)
        path = f"{base}-{rank:04d}{ext or '.safetensors'}"
        clean_stale_temporaries_of(path)
        save_lora_state_dict(path, cut, md)
        print(f"saved {path}: rank {rank}")


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
