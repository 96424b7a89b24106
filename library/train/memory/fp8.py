"""--fp8_base: frozen Linear / Conv2d weights stored as float8 (e4m3) and upcast layer by layer.

Each converted layer keeps its weight under the same name (`weight`), as a float8
buffer rather than a parameter, so state-dict keys do not change and `model.dtype`
(the first floating *parameter*: a bias or a norm) still reports the compute dtype.
The layer's forward becomes an instance attribute set here, so a LoRA that later
wraps `module.forward` (networks/lora_module.py) wraps the upcasting forward.

The upcast copy is made inside a small autograd Function that saves the float8
weight itself, not the copy, for the backward pass: without gradient checkpointing
the graph then holds float8 weights only (and block swap can move them off the GPU).
Biases keep the training dtype. Modules a model class keeps in float32
(`_keep_in_fp32_modules`, e.g. T5's `wo`) are left alone.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448; larger magnitudes are clamped, not turned into NaN


def to_fp8(weight: torch.Tensor) -> torch.Tensor:
    """`weight` rounded to float8 e4m3 (clamped to its range)."""
    return weight.detach().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a Linear on `x` computes in: the autocast dtype when autocast is on, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class _UpcastLinear(torch.autograd.Function):
    """y = x Wᵀ + b with W upcast for this call only; backward gives the input's gradient only (W is frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = _compute_dtype(x)
        ctx.save_for_backward(weight)
        ctx.dtypes = (x.dtype, dtype)
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        x_dtype, dtype = ctx.dtypes
        return (grad.to(dtype) @ weight.to(dtype)).to(x_dtype), None, None


class _UpcastConv2d(torch.autograd.Function):
    """conv2d with the weight upcast for this call only; backward gives the input's gradient only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv: nn.Conv2d):
        dtype = _compute_dtype(x)
        ctx.save_for_backward(weight)
        ctx.meta = (x.shape, x.dtype, dtype, conv.stride, conv.padding, conv.dilation, conv.groups)
        return F.conv2d(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                        conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        shape, x_dtype, dtype, stride, padding, dilation, groups = ctx.meta
        grad_x = torch.nn.grad.conv2d_input(shape, weight.to(dtype), grad.to(dtype), stride, padding, dilation, groups)
        return grad_x.to(x_dtype), None, None, None


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _UpcastLinear.apply(x, module.weight, module.bias)


def _conv2d_forward(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return _UpcastConv2d.apply(x, module.weight, module.bias, module)


def _convertible(module: nn.Module, frozen_only: bool = True) -> bool:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or (frozen_only and weight.requires_grad):
        return False
    if isinstance(module, nn.Linear):
        return True
    # conv2d_input needs numeric padding; other padding modes pad outside F.conv2d.
    return isinstance(module, nn.Conv2d) and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def _kept_in_fp32(model: nn.Module) -> tuple[str, ...]:
    return tuple(getattr(model, "_keep_in_fp32_modules", None) or ())


def cast_base_to_fp8(model: nn.Module) -> int:
    """Store every frozen Linear / Conv2d weight of `model` as float8 with an upcasting forward; returns how many.

    Call before a LoRA wraps the layers and after anything is merged into the weights.
    """
    keep = _kept_in_fp32(model)
    count = 0
    for name, module in model.named_modules():
        if getattr(module, "_fp8_base", False) or not _convertible(module):
            continue
        if keep and any(part in keep for part in name.split(".")):
            continue
        fp8 = to_fp8(module.weight)
        del module.weight  # drop the Parameter; the buffer takes its name (same state-dict key)
        module.register_buffer("weight", fp8)
        forward = _linear_forward if isinstance(module, nn.Linear) else _conv2d_forward
        module.forward = functools.partial(forward, module)
        module._fp8_base = True
        count += 1
    return count


def fp8_round_trip_(model: nn.Module) -> int:
    """Round each weight cast_base_to_fp8 would convert (once frozen) through float8 in place, keeping its dtype.

    The reference for tests: a model so rounded computes what the float8 model computes.
    """
    keep = _kept_in_fp32(model)
    count = 0
    for name, module in model.named_modules():
        if not _convertible(module, frozen_only=False) or (keep and any(part in keep for part in name.split("."))):
            continue
        module.weight.data = to_fp8(module.weight).to(module.weight.dtype)
        count += 1
    return count


def fp8_layers(modules: Iterable[nn.Module]) -> int:
    """How many layers of `modules` hold float8 weights."""
    return sum(1 for m in modules for sub in m.modules() if getattr(sub, "_fp8_base", False))
