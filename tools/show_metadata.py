"""Print a LoRA's metadata as sorted JSON; --keys adds its tensors and a summary (LyCORIS files too).

    python tools/show_metadata.py my_lora.safetensors
    python tools/show_metadata.py my_lora.safetensors --keys
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a .safetensors file")
    p.add_argument("--keys", action="store_true", help="also list tensors with shapes and a summary")
    return p


def _decoded(metadata: dict) -> dict:
    # ss_* values holding JSON (datasets, tag frequency, network_args) print as JSON, not as escaped strings.
    out = {}
    for k, v in metadata.items():
        try:
            out[k] = json.loads(v) if v[:1] in "{[" else v
        except ValueError:
            out[k] = v
    return out


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from library.families.lora_convert import load_lora_file
    from networks.lora_files import (
        lycoris_algo,
        read_state_dict,
        summarize,
        summarize_lycoris,
    )

    state, metadata = read_state_dict(args.model)
    print(json.dumps(_decoded(metadata), indent=2, sort_keys=True, ensure_ascii=False))
    if args.keys:
        for key in sorted(state):
            print(f"{key}\t{list(state[key].shape)}\t{str(state[key].dtype).replace('torch.', '')}")
        if any(lycoris_algo(key) for key in state):  # LoHa, LoKr, ...: the LoRA summary does not apply
            print(json.dumps(summarize_lycoris(state, metadata), indent=2))
        else:
            print(json.dumps(summarize(load_lora_file(args.model)), indent=2))


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
