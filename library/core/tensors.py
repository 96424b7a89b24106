"""Tensor helpers with no model knowledge."""

from __future__ import annotations

from typing import Mapping

import torch

ALIGNMENT = 64  # bytes: what CPU matmul kernels assume for their fastest (and bitwise-stable) paths


def aligned(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `state_dict`, each copied when its data is not ALIGNMENT-aligned.

    Tensors read from a safetensors file (or split from a fused one) may start at any
    byte offset. A model that adopts them as its parameters (`load_state_dict(assign=True)`)
    then runs other kernels than one built in memory, which differ in the last bit.
    """
    return {k: v if v.data_ptr() % ALIGNMENT == 0 else v.clone() for k, v in state_dict.items()}


def unshared(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `state_dict`, each one that shares its storage with another entry (or is a view of part of
    a larger tensor, such as q/k/v split from a fused projection) replaced by a contiguous copy.

    safetensors refuses to write tensors that share memory ("Some tensors share memory"); a tensor that owns
    its whole storage is passed through as it is.
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        storage = value.untyped_storage()
        whole = value.is_contiguous() and storage.nbytes() == value.numel() * value.element_size()
        if value.numel() and (not whole or storage.data_ptr() in seen):
            value = value.clone(memory_format=torch.contiguous_format)
        elif value.numel():
            seen.add(storage.data_ptr())
        out[key] = value
    return out
