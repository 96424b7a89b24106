"""Print each adapter weight's shape, mean |w| and min |w| (sd-scripts' networks/check_lora_weights.py).

    python networks/check_lora_weights.py my_lora.safetensors [-s] [--show_max]

One line per weight, as sd-scripts prints it: `key,(d0-d1-...),mean(|w|),min(|w|)` (`--show_max` adds
max(|w|) as a fifth column). The weights listed are every adapter tensor we write: LoRA / LoCon / DyLoRA
(`lora_down`, `lora_up`; diffusers/PEFT `lora_A`, `lora_B`), OFT (`oft_*`) and the LyCORIS ones (LoHa
`hada_*`, LoKr `lokr_*`, DoRA `dora_scale`, IA3, GLoRA, `full`); `-s` / `--show_all_keys` adds every other
tensor (alpha, ...). A zero min or mean shows a module that never trained (an all-zero `lora_up`).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ADAPTER_MARKERS = ("lora_up", "lora_down", "lora_A", "lora_B", "oft_")


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=str, help="model file to check (.safetensors, or a .pt / .ckpt of tensors)")
    p.add_argument("-s", "--show_all_keys", action="store_true", help="show all keys, not only the adapter weights")
    p.add_argument("--show_max", action="store_true", help="also print max(|w|) as a fifth column (ours)")
    return p


def is_adapter_key(key: str) -> bool:
    """Whether `key` is an adapter weight (LoRA, OFT or a LyCORIS algorithm), not alpha or other bookkeeping."""
    from networks.lora_files import lycoris_algo

    return any(marker in key for marker in ADAPTER_MARKERS) or lycoris_algo(key) is not None


def weight_lines(state: dict, show_all_keys: bool = False, show_max: bool = False) -> list[str]:
    """The lines sd-scripts prints: the module count, then one CSV line per listed tensor."""
    import torch

    keys = list(state)
    listed = [k for k in keys if is_adapter_key(k)]
    lines = [f"number of LoRA modules: {len(listed)}"]
    if show_all_keys:
        shown = set(listed)
        listed += [k for k in keys if k not in shown]
        lines.append(f"number of all modules: {len(listed)}")
    for key in listed:
        value = state[key].detach().to(torch.float32).abs()
        shape = str(tuple(value.size())).replace(", ", "-")
        if value.numel() == 0:
            line = f"{key},{shape},nan,nan"
        else:
            line = f"{key},{shape},{torch.mean(value)},{torch.min(value)}"
            if show_max:
                line += f",{torch.max(value)}"
        lines.append(line)
    return lines


def _read(path: str) -> dict:
    import pickle

    import torch

    from library.core.errors import UserError
    from networks.lora_files import read_state_dict

    try:
        state, _ = read_state_dict(path)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise UserError(f"{path}: not a safetensors file nor a torch file of tensors ({str(e).splitlines()[0]})") \
            from None
    bad = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise UserError(f"{path}: {bad} is not a tensor (expected a state dict of tensors)")
    return state


def run(argv=None) -> None:
    args = setup_parser().parse_args(argv)
    state = _read(args.file)
    for line in weight_lines(state, args.show_all_keys, args.show_max):
        print(line)


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
