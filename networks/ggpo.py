"""LoRA-GGPO (gradient-guided perturbation), sd-scripts' `ggpo_sigma` / `ggpo_beta` of networks/lora_flux.py.

While training, each LoRA on a Linear adds a random perturbation of the base weight to its output:

    out += x @ Pᵀ,    P = N(0, 1)[out, in] · (σ·‖W₀ + ΔW‖_row + β·‖∇ΔW‖²_row) / √out

computed without gradient, so it only shakes the forward pass (the loss landscape the LoRA sees), never the
saved weights or their layout. The norms are per output row:

- ‖W₀ + ΔW‖_row = √(‖W₀‖²_est + ‖ΔW_row‖²) with ‖W₀‖_est the mean row norm of up to 1000 sampled rows of the
  base weight (measured once, when GGPO is attached);
- ‖∇ΔW‖_row, the row norm of scale · (up @ ∇down + ∇up @ down), the first-order gradient of ΔW.

Both are refreshed after each optimizer-step's gradients are in (after clipping, before the step; the
trainer calls `update_grad_norms` then `update_norms`, as sd-scripts' train_network.py), so the first step
trains without perturbation. Differences from sd-scripts: ΔW in the weight norm carries the LoRA's scale
(sd-scripts computes `module_weights.mul(scale)` and drops the result), and fused FLUX modules (one kohya
`qkv` / `linear1` over several diffusers projections) take the norms of the fused layer, each projection
perturbed with its own rows of P.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class GGPO:
    """The GGPO state of one LoRA module (LoRAModule or FusedLoRAModule) over Linear base layers."""

    def __init__(self, module: nn.Module, sigma: float, beta: float):
        self.sigma, self.beta = float(sigma), float(beta)
        orgs = getattr(module, "org_modules", None) or (module.org_module,)
        self.rows = sum(m.out_features for m in orgs)
        self.in_features = orgs[0].in_features
        self.norm_factor = 1.0 / math.sqrt(self.rows)
        self.org_norm_estimate = _sampled_row_norm([m.weight for m in orgs])
        self.combined_weight_norms: Optional[torch.Tensor] = None  # [rows, 1]
        self.grad_norms: Optional[torch.Tensor] = None  # [rows, 1]
        self.weight_norms: Optional[torch.Tensor] = None  # ‖ΔW_row‖, for logging

    @torch.no_grad()
    def update_norms(self, module: nn.Module) -> None:
        delta = module.lora_up.weight.float() @ module.lora_down.weight.float() * float(module.scale)
        self.weight_norms = delta.norm(dim=1, keepdim=True)
        self.combined_weight_norms = torch.sqrt(self.org_norm_estimate.to(delta.device) ** 2
                                                + delta.pow(2).sum(dim=1, keepdim=True))

    @torch.no_grad()
    def update_grad_norms(self, module: nn.Module) -> None:
        down, up = module.lora_down.weight, module.lora_up.weight
        if down.grad is None or up.grad is None:
            return
        approx = float(module.scale) * (up.float() @ down.grad.float() + up.grad.float() @ down.float())
        self.grad_norms = approx.norm(dim=1, keepdim=True)

    def active(self) -> bool:
        return self.combined_weight_norms is not None and self.grad_norms is not None

    @torch.no_grad()
    def perturbation(self, x: torch.Tensor, dtype: torch.dtype, start: int = 0,
                     stop: Optional[int] = None) -> torch.Tensor:
        """x @ Pᵀ for rows start:stop of the (fused) layer; call only when `active()`."""
        stop = self.rows if stop is None else stop
        scale = (self.sigma * self.combined_weight_norms[start:stop]
                 + self.beta * self.grad_norms[start:stop] ** 2) * self.norm_factor
        noise = torch.randn((stop - start, self.in_features), device=scale.device, dtype=torch.float32)
        noise.mul_(scale)
        return (x.to(noise.dtype) @ noise.T).to(dtype)


@torch.no_grad()
def _sampled_row_norm(weights: list[torch.Tensor]) -> torch.Tensor:
    """Mean row norm of up to 1000 random rows of the stacked weights (float32), as sd-scripts estimates it."""
    sizes = [w.shape[0] for w in weights]
    total = sum(sizes)
    indices = torch.randperm(total)[:min(1000, total)].sort().values
    rows, offset = [], 0
    for w, n in zip(weights, sizes):
        pick = indices[(indices >= offset) & (indices < offset + n)] - offset
        if len(pick):
            rows.append(w.detach()[pick.to(w.device)].float())
        offset += n
    return torch.cat(rows).norm(dim=1).mean()


def attach(loras: list[nn.Module], sigma: float, beta: float) -> int:
    """Give every LoRA on Linear layers its GGPO state; returns how many got one (others train as before)."""
    count = 0
    for lora in loras:
        orgs = getattr(lora, "org_modules", None) or (lora.org_module,)
        if all(isinstance(m, nn.Linear) for m in orgs):
            lora.ggpo = GGPO(lora, sigma, beta)
            count += 1
    return count
