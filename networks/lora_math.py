"""Pure tensor math of a kohya-format LoRA module, shared by the network and the tools.

A module stores `down` (rank r) and `up`; its weight update is

    ΔW = up @ down * alpha / r

laid out like the base weight: `[out, in]` for a Linear, `[out, in, 1, 1]` for a
1x1 conv and `[out, in, k, k]` for a k×k conv (where `down` is k×k and `up` 1x1).
Nothing here builds a module or touches a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

Number = Union[float, int, torch.Tensor]


def lora_scale(alpha: Optional[Number], rank: int) -> float:
    """alpha / rank; an alpha of None or 0 means alpha = rank (scale 1), as sd-scripts."""
    if isinstance(alpha, torch.Tensor):
        alpha = float(alpha.detach().float().cpu())
    if alpha is None or alpha == 0:
        return 1.0
    return float(alpha) / rank


def delta_weight(down: torch.Tensor, up: torch.Tensor, alpha: Optional[Number] = None,
                 out_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """ΔW of one module in the base weight's layout, computed in the inputs' dtype.

    `out_shape` reshapes the result, e.g. to apply a 2-D (Linear) LoRA onto a
    1x1-conv base weight of the same size.
    """
    rank = down.shape[0]
    if down.dim() == 2:
        dw = up @ down
    elif down.shape[2:] == (1, 1) and up.shape[2:] == (1, 1):
        dw = (up.flatten(1) @ down.flatten(1))[:, :, None, None]
    else:
        # k×k down then 1x1 up: treat the `in` axis of down as a batch of r-channel
        # k×k images and mix their channels with up; the result is [out, in, k, k].
        dw = F.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
    dw = dw * lora_scale(alpha, rank)
    if out_shape is not None:
        dw = dw.reshape(tuple(out_shape))
    return dw


def merge_into(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor, alpha: Optional[Number],
               ratio: float = 1.0) -> torch.Tensor:
    """weight + ratio * ΔW, computed in float32 and returned in weight's dtype and device."""
    dw = delta_weight(down.to(weight.device, torch.float32), up.to(weight.device, torch.float32), alpha,
                      out_shape=weight.shape)
    return (weight.to(torch.float32) + ratio * dw).to(weight.dtype)


@dataclass(frozen=True)
class MaxNormResult:
    """How one module is rescaled by `--scale_weight_norms`."""

    ratio: float  # multiply ΔW by this (1.0: unchanged)
    factor: float  # multiply both up and down by this (sqrt of ratio)
    norm: float  # ‖ΔW‖_F after rescaling

    @property
    def scaled(self) -> bool:
        return self.ratio != 1.0


def frobenius_scale_for_max_norm(down: torch.Tensor, up: torch.Tensor, alpha: Optional[Number],
                                 max_norm: float) -> MaxNormResult:
    """sd-scripts' scale_weight_norms rule for one module.

    n = max(‖ΔW‖_F, max_norm/2); ratio = min(n, max_norm)/n. The floor at
    max_norm/2 only keeps the division safe; a norm below max_norm gives ratio 1.
    """
    dw = delta_weight(down.float(), up.float(), alpha)
    norm = float(dw.norm())
    clamped = max(norm, max_norm / 2)
    ratio = min(clamped, max_norm) / clamped
    return MaxNormResult(ratio=ratio, factor=ratio ** 0.5, norm=norm * ratio)
