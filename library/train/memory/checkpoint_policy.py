"""--gradient_checkpointing_policy: which activations a checkpointed block keeps (torch's selective checkpointing).

`full` (sd-scripts' --gradient_checkpointing): a block keeps only its inputs, and backward reruns its whole
forward. The other policies run the block under torch.utils.checkpoint's selective checkpoint contexts: the
outputs of the listed operators are saved in the forward pass (kept as the uncheckpointed model would keep them),
everything else is recomputed in backward from the block inputs and those saved outputs:

- `attention`: the outputs of scaled-dot-product attention (the most compute per stored byte: a block's attention
  output is one token-state-sized tensor, and recomputing it is the block's largest kernel at high resolutions);
- `matmul`: those, plus every matrix product (mm / addmm / bmm / baddbmm: the Linear layers) and convolution,
  so backward recomputes only the elementwise, normalisation and reshaping operators.

The recomputed operators are the same ones on the same inputs, so gradients are bitwise those of `full` where the
kernels are deterministic (tests/test_selective_checkpointing.py). Measured costs: docs/performance.md.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

POLICIES = ("full", "attention", "matmul")


def _ops(*names: str) -> frozenset:
    """The aten overloads among `names` that this torch build has (a CPU build lacks none of them today;
    the fused attention kernels differ between versions)."""
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            found.add(getattr(packet, overload))
    return frozenset(found)


ATTENTION_OPS = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                     "_efficient_attention_forward")
MATMUL_OPS = ATTENTION_OPS | _ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
                                  "mkldnn_convolution", "cudnn_convolution", "_int_mm", "_scaled_mm")
SAVED_OPS = {"attention": ATTENTION_OPS, "matmul": MATMUL_OPS}


def keeps_products(policy: str) -> bool:
    """Whether `policy` keeps the outputs of matrix products or convolutions, which the fused LoRA products
    (networks/lora_matmul.py) add their update into in place: a kept output must not change after it is kept."""
    return bool(SAVED_OPS.get(policy, frozenset()) & (MATMUL_OPS - ATTENTION_OPS))


def _policy(saved: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn(policy: str) -> Callable[[], tuple[Any, Any]]:
    """torch.utils.checkpoint's `context_fn` for a selective policy (`attention` / `matmul`)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    saved = SAVED_OPS[policy]
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, saved))


def selective_checkpoint(policy: str) -> Callable[..., Any]:
    """diffusers' gradient_checkpointing_func under a selective policy (non-reentrant, keyword inputs taken)."""
    make_contexts = context_fn(policy)

    def checkpoint(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False,
                                                 context_fn=make_contexts, **kwargs)

    checkpoint.policy = policy  # type: ignore[attr-defined]  # for the log and the tests
    return checkpoint
