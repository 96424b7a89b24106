"""What the original single-file DiT layouts of FLUX.2, Z-Image, Lumina and HunyuanImage share: ComfyUI's
whole-model prefix, the rows of a fused projection joined in slot order, and block counts read from key names.

The families' own tables (which diffusers module goes to which original one, which slot) stay in their layout.py.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Optional

import torch

COMFY_PREFIX = "model.diffusion_model."


def strip_prefix(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT's own tensors of an original file: ComfyUI's `model.diffusion_model.` dropped; other keys of a
    whole-model file (text encoder, VAE) left out when the prefix is there."""
    if any(k.startswith(COMFY_PREFIX) for k in tensors):
        return {k[len(COMFY_PREFIX):]: v for k, v in tensors.items() if k.startswith(COMFY_PREFIX)}
    return dict(tensors)


def fuse_slots(fused: Mapping[str, Mapping[int, torch.Tensor]], slot_counts: tuple[int, ...] = (3,),
               what: str = "q, k and v") -> dict[str, torch.Tensor]:
    """{original key: the parts' rows joined in slot order} for {key: {slot: tensor}}; every key must hold slots
    0..n-1 with n one of `slot_counts` (a ValueError naming the key and `what` otherwise)."""
    out = {}
    for key, parts in fused.items():
        slots = sorted(parts)
        if slots != list(range(len(slots))) or len(slots) not in slot_counts:
            raise ValueError(f"{key}: expected {what} to fuse, found slots {slots}")
        out[key] = torch.cat([parts[i] for i in slots], dim=0)
    return out


def to_original_fused(state: Mapping[str, torch.Tensor],
                      original_module: Callable[[str], tuple[str, Optional[int]]], *,
                      adjust: Optional[Callable[[str, str, torch.Tensor], tuple[str, torch.Tensor]]] = None,
                      slot_counts: tuple[int, ...] = (3,), what: str = "q, k and v") -> dict[str, torch.Tensor]:
    """A diffusers DiT state dict -> the original file's tensors: each parameter renamed by the family's
    `original_module(module path) -> (original path, slot or None)`, the slotted ones joined (fuse_slots).
    `adjust(original path, leaf, tensor) -> (leaf, tensor)`: a family's own per-tensor change (a norm's leaf
    name, swapped halves) before it is placed."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        name, slot = original_module(module)
        if adjust is not None:
            leaf, value = adjust(name, leaf, value)
        original = f"{name}.{leaf}" if name else leaf
        if slot is None:
            out[original] = value
        else:
            fused.setdefault(original, {})[slot] = value
    out.update(fuse_slots(fused, slot_counts, what))
    return out


def count_blocks(tensors: Mapping[str, torch.Tensor], kind: str) -> int:
    """How many blocks `kind.N.` (a regular expression) the keys of an original state dict hold."""
    return len({m[1] for k in tensors if (m := re.match(rf"{kind}\.(\d+)\.", k))})


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """The two halves of dim 0 swapped: an AdaLN projection's (shift, scale) <-> diffusers' (scale, shift)."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)
