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
