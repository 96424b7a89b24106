"""One LoRA adapter on one Linear or Conv2d: out = org(x) + up(drop(down(x))) * multiplier * alpha/dim.

Wrapping is by replacing the original module's forward, so the base model's own
state dict keys stay untouched; `restore()` undoes it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from networks import lora_math
from networks.lora_matmul import applies, lora_linear, takes_update_in_place


def init_lora_parameters(module: nn.Module, lora_dim: int, alpha: Any, multiplier: float, dropout: Optional[float],
                         rank_dropout: Optional[float], module_dropout: Optional[float], device: Any) -> None:
    """sd-scripts' init and settings of a LoRA's `lora_down` / `lora_up`: kaiming / zeros, alpha
    (0 or None means dim) as a 0-dim buffer, scale = alpha / dim, multiplier and dropouts."""
    nn.init.kaiming_uniform_(module.lora_down.weight, a=math.sqrt(5))
    nn.init.zeros_(module.lora_up.weight)
    if isinstance(alpha, torch.Tensor):
        alpha = float(alpha.detach().float().cpu())
    alpha = lora_dim if alpha is None or alpha == 0 else alpha
    module.register_buffer("alpha", torch.tensor(float(alpha), device=device))
    module.scale = lora_math.lora_scale(alpha, lora_dim)
    module.multiplier = multiplier
    module.dropout = dropout
    module.rank_dropout = rank_dropout
    module.module_dropout = module_dropout
    module.ggpo = None  # networks/ggpo.py state, set by the network with ggpo_sigma / ggpo_beta (training only)


class LoRAModule(nn.Module):
    """A LoRA on one Linear / Conv2d: out = org(x) + up(down(x)) * multiplier * alpha/dim.

    The original module is not replaced: its `forward` is swapped for ours by
    `apply_to()` and put back by `restore()`, so the base model's own state_dict
    keys never change.
    """

    def __init__(self, lora_name: str, org_module: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: Optional[Union[float, torch.Tensor]] = 1.0, dropout: Optional[float] = None,
                 rank_dropout: Optional[float] = None, module_dropout: Optional[float] = None):
        super().__init__()
        self.lora_name = lora_name
        self.lora_dim = lora_dim
        device = org_module.weight.device
        if isinstance(org_module, nn.Conv2d):
            self.lora_down = nn.Conv2d(org_module.in_channels, lora_dim, org_module.kernel_size, org_module.stride,
                                       org_module.padding, org_module.dilation, bias=False, device=device)
            self.lora_up = nn.Conv2d(lora_dim, org_module.out_channels, 1, 1, bias=False, device=device)
        elif isinstance(org_module, nn.Linear):
            self.lora_down = nn.Linear(org_module.in_features, lora_dim, bias=False, device=device)
            self.lora_up = nn.Linear(lora_dim, org_module.out_features, bias=False, device=device)
        else:
            raise TypeError(f"{lora_name}: LoRA supports Linear and Conv2d, not {type(org_module).__name__}")
        init_lora_parameters(self, lora_dim, alpha, multiplier, dropout, rank_dropout, module_dropout, device)
        # Held outside the module tree so the base weights never enter our state_dict.
        self._org: tuple[nn.Module, ...] = (org_module,)
        self._org_forward: Optional[Callable] = None
        self._org_had_own_forward = False
        # networks/lora_matmul.py: the LoRA's products fused with the frozen layer's (merged where exact); the
        # trainer turns it on (library/train/speedups.py, --no_fused_lora keeps the plain formula)
        self.fused_matmul = False

    @property
    def org_module(self) -> nn.Module:
        return self._org[0]

    def apply_to(self) -> None:
        """Route the original module's forward through this LoRA."""
        if self._org_forward is not None:
            return
        org = self.org_module
        self._org_had_own_forward = "forward" in org.__dict__
        self._org_forward = org.forward
        org.forward = self.forward

    def restore(self) -> None:
        """Give the original module its own forward back."""
        if self._org_forward is None:
            return
        org = self.org_module
        if self._org_had_own_forward:
            org.forward = self._org_forward
        else:
            del org.forward
        self._org_forward = None

    def refresh_scale(self) -> None:
        """Recompute the scale from the `alpha` buffer (after loading weights)."""
        self.scale = lora_math.lora_scale(self.alpha, self.lora_dim)

    def _fuses(self, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        org = self.org_module
        plain = not (self.training and (self.dropout or self.rank_dropout
                                        or (self.ggpo is not None and self.ggpo.active())))
        return (self.fused_matmul and plain and not args and not kwargs and not self._org_had_own_forward
                and type(org) is nn.Linear and applies(x, org, self.lora_down.weight, self.lora_up.weight))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.training and self.module_dropout is not None and torch.rand(1) < self.module_dropout:
            return self._org_forward(x, *args, **kwargs)
        if self._fuses(x, args, kwargs):
            return lora_linear(x, self.org_module, self.lora_down.weight, self.lora_up.weight,
                               self.multiplier * self.scale)
        org_out = self._org_forward(x, *args, **kwargs)
        lx = self.lora_down(x.to(self.lora_down.weight.dtype))
        if self.training and self.dropout is not None:
            lx = nn.functional.dropout(lx, p=self.dropout)
        scale = self.scale
        if self.training and self.rank_dropout is not None:
            mask = torch.rand((lx.size(0), self.lora_dim), device=lx.device) > self.rank_dropout
            if lx.dim() == 3:  # (B, tokens, r): text encoder
                mask = mask.unsqueeze(1)
            elif lx.dim() == 4:  # (B, r, H, W): conv
                mask = mask[:, :, None, None]
            lx = lx * mask.to(lx.dtype)
            scale = scale / (1.0 - self.rank_dropout)  # keep the expected update unchanged
        lx = self.lora_up(lx)
        if self.fused_matmul and takes_update_in_place(self.org_module, self._org_had_own_forward, org_out):
            # the same sum without the scaled copy (a Conv2d's output; a Linear's that lora_linear did not take)
            out = org_out.add_(lx, alpha=self.multiplier * scale)
        else:
            out = org_out + (lx * (self.multiplier * scale)).to(org_out.dtype)
        if self.training and self.ggpo is not None and self.ggpo.active():
            out = out + self.ggpo.perturbation(x, out.dtype)
        return out

    def delta_weight(self) -> torch.Tensor:
        """ΔW at multiplier 1 in the original weight's layout (float32)."""
        org = self.org_module
        # a quantized Linear's stored weight may be packed (bitsandbytes' 4-bit: one column of bytes)
        shape = (org.out_features, org.in_features) if isinstance(org, nn.Linear) else org.weight.shape
        return lora_math.delta_weight(self.lora_down.weight.float(), self.lora_up.weight.float(), self.alpha,
                                      out_shape=shape)
