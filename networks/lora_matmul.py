"""A LoRA'd Linear as one autograd function: the LoRA's products fused with the frozen layer's (issue 28, a
default speed-up; `--no_fused_lora` keeps the plain formula).

The plain LoRA forward, as sd-scripts and peft write it, is `org(x) + up(down(x)) * c` (c = multiplier * alpha /
dim): three products, then a scaled copy, a cast and a sum over every output element; autograd's backward adds
a product and a sum over every input element, and takes the rank-r gradients in a slow layout. `lora_linear`
computes the same sums with fewer passes:

- merged, when the product runs at full float32 precision and there are enough rows to pay for it (`pays`): the
  frozen weight and the LoRA are merged into a temporary `W + c * up @ down` and the forward is one product the
  size of the frozen layer's own; backward recomputes the merged weight (keeping it would cost a copy of every
  LoRA'd weight) for the input's gradient, one product.
- fused otherwise: the frozen product, then the LoRA's update added into its output in the last product's
  epilogue (`addmm_`, or one add in the output's dtype), with no scaled copy; the input's gradient likewise.

Either way the LoRA's gradients come from the rank-r projections (`up`: c * g^T (x down^T); `down`: c * (g up)^T
x), never forming the (out x in) gradient of a merged weight, and are taken with r as the rows of each result,
2.5-4x faster than autograd's layout on the CPU (MKL, 320 -> 2560 at 4096 rows: 9.0 against 33.6 ms).

Merging into a bfloat16 / float16 (or TF32-rounded) weight would round the LoRA's update to the weight's few
mantissa bits, which the plain path keeps apart, so a low-precision base weight is only fused: the update is
computed in the LoRA's float32 and added to the output once (one rounding where the plain path rounds the scaled
update and then the sum).

Under autocast (`--mixed_precision bf16` / `fp16` on a GPU) the plain formula's four products run in autocast's
dtype, the LoRA weights cast to it; so does the fused function: its inputs are cast as autocast casts them (the
casts are differentiable, so the float32 LoRA weights get their gradients as before) and it runs with autocast off,
the update added in the last product's epilogue, scaled there (the plain path rounds the product, the scaled copy
and the sum). It is not merged then: the merged weight would be rounded to that dtype.

`applies` says when the function computes the plain formula: no dropout of any kind, float32 LoRA weights, plain
frozen tensors (not a DTensor or a quantized weight), the frozen weight in the input's dtype or autocast on.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)  # not a DTensor (FSDP2 / tensor parallel) or a quantized subclass
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def pays(rows: int, in_features: int, out_features: int) -> bool:
    """Whether merging is faster than fusing for `rows` input vectors: it replaces the rank-r products over rows x
    (in + out) values with two merges over in x out, so it pays from rows about the harmonic mean of in and out up.
    Measured, CPU, one thread, rank 8, forward + backward as a fraction of the plain formula's time, fused / merged:
    320 x 320 0.90 / 0.89 at 256 rows, 0.81 / 0.79 at 4096; 1280 x 1280 0.97 / 1.03 at 256, 0.91 / 0.89 at 4096;
    320 x 2560 0.64 / 0.62 at 4096; 1280 x 10240 0.83 / 0.88 at 1024, 0.96 / 1.72 at 77."""
    return rows * (in_features + out_features) >= 2 * in_features * out_features


def add_scaled(out: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor, scale: float) -> torch.Tensor:
    """out += scale * lhs @ rhs, in place: in the product's epilogue when out and lhs agree (rhs cast to them, as
    autocast casts a float32 LoRA weight), else one add."""
    if out.dtype == lhs.dtype:
        return out.addmm_(lhs, rhs.to(lhs.dtype), alpha=scale)
    return out.add_(lhs @ rhs, alpha=scale)  # one pass, computed in float32 and rounded once


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, down, up, scale, merge):
        ctx.save_for_backward(x, weight, down, up)
        ctx.scale, ctx.merge = scale, merge
        if merge:
            return F.linear(x, torch.addmm(weight, up, down, alpha=scale), bias)
        out = F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        add_scaled(out.view(-1, out.shape[-1]), x2.to(down.dtype) @ down.t(), up.t(), scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, down, up = ctx.saved_tensors
        scale = ctx.scale
        g = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        need_x, _, need_bias, need_down, need_up = ctx.needs_input_grad[:5]
        grad_x = grad_bias = grad_down = grad_up = None
        # r x rows: (g up)^T, the same sums as g @ up in the layout the rank-r products below take fastest
        g_up_t = up.t().mm(g.to(up.dtype).t()) if (need_down or (need_x and not ctx.merge)) else None
        if need_x:
            if ctx.merge:
                grad_x = g @ torch.addmm(weight, up, down, alpha=scale)
            else:
                grad_x = add_scaled(g @ weight, g_up_t.t(), down, scale)
            grad_x = grad_x.view(x.shape)
        if need_bias:
            grad_bias = g.sum(0)
        if need_down:
            grad_down = g_up_t.mm(x2.to(down.dtype)).mul_(scale)
        if need_up:
            grad_up = down.mm(x2.to(down.dtype).t()).mm(g.to(up.dtype)).t().mul(scale)
        return grad_x, None, grad_bias, grad_down, grad_up, None, None


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast runs x's products in, or None when it is off on x's device."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def merges(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `lora_linear` merges for this call: float32 input and weight, full float32 products (not TF32 or
    oneDNN's bfloat16 math mode: `torch.set_float32_matmul_precision` at "highest"), and enough rows (`pays`)."""
    return (weight.dtype == torch.float32 and x.dtype == torch.float32
            and torch.get_float32_matmul_precision() == "highest"
            and pays(x.numel() // max(x.shape[-1], 1), weight.shape[1], weight.shape[0]))


def lora_linear(x: torch.Tensor, org: nn.Linear, down: torch.Tensor, up: torch.Tensor, scale: float) -> torch.Tensor:
    """`org(x) + (x @ down^T @ up^T) * scale` as one autograd function, merged where that is exact and pays; under
    autocast in autocast's dtype, as the plain formula runs there."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return _LoRALinear.apply(x, org.weight, org.bias, down, up, scale, merges(x, org.weight))
    bias = None if org.bias is None else org.bias.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _LoRALinear.apply(x.to(dtype), org.weight.to(dtype), bias, down.to(dtype), up.to(dtype), scale, False)


def takes_update_in_place(org: nn.Module, had_own_forward: bool, out: torch.Tensor) -> bool:
    """Whether a LoRA may add its update into `out`, org(x)'s output, in place: a plain Linear's or Conv2d's fresh
    output (their backward keeps only the input and the weight), in a floating-point dtype (under autocast, its
    dtype: the update is computed in it too, as the plain formula computes it there)."""
    return type(org) in (nn.Linear, nn.Conv2d) and not had_own_forward and out.dtype in _FLOATS


def applies(x: torch.Tensor, org: nn.Module, down: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `lora_linear` computes the plain formula for this call: a frozen floating-point Linear of plain
    tensors on x's device, in x's dtype (any, under autocast to bfloat16 / float16), float32 LoRA weights."""
    weight, bias = org.weight, org.bias
    autocast = autocast_dtype(x)
    dtypes_fit = (weight.dtype == x.dtype if autocast is None
                  else autocast in (torch.bfloat16, torch.float16) and weight.dtype in _FLOATS)
    return (x.dtype in _FLOATS and dtypes_fit and weight.dim() == 2 and down.dtype == torch.float32
            and up.dtype == torch.float32 and type(weight) in _PLAIN_TENSORS and type(down) in _PLAIN_TENSORS
            and type(up) in _PLAIN_TENSORS and not weight.requires_grad
            and (bias is None or (type(bias) in _PLAIN_TENSORS and not bias.requires_grad))
            and weight.device == x.device == down.device)
