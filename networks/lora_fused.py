"""A LoRA on several projections that read the same input, saved as one fused kohya module.

FLUX.1's original (BFL) layout has one `qkv` Linear per attention and one
`linear1` (q, k, v and the MLP input) per single block; diffusers splits them
into separate Linears. All of them read the same input, so one LoRA on the
fused layer is exactly

    ΔW_fused = up @ down · alpha / r,     up = [up_q; up_k; up_v (; up_mlp)]

with ONE shared `down`: each diffusers projection gets `up_i @ down`. Training
that module on the split layers and saving `down`, the stacked `up` and `alpha`
gives the fused kohya file with the same rank and alpha, loadable everywhere a
BFL-layout Flux LoRA is.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from networks import lora_math
from networks.lora_matmul import add_scaled, takes_update_in_place
from networks.lora_module import init_lora_parameters


class FusedLoRAModule(nn.Module):
    """One shared lora_down, one lora_up whose row slices feed each original Linear in turn.

    Has the attributes the network reads from a LoRAModule (`lora_name`, `lora_dim`,
    `lora_down`, `lora_up`, `alpha`, `scale`, `multiplier`, `apply_to`, `restore`,
    `refresh_scale`, `delta_weight`) plus `merge_weights` for merging into the base.

    `split` (sd-scripts' `split_qkv`): each projection gets its own rank-`lora_dim / n` LoRA
    instead of sharing one down. Projection i reads only rows i·r..(i+1)·r of `lora_down` and the
    matching columns of its slice of `lora_up`, so `lora_up` stays block-diagonal (the other
    entries get no gradient and stay zero) and the stacked tensors are exactly the fused kohya
    module of rank n·r that sd-scripts writes for a split qkv. The caller passes the total rank
    n·r and alpha n·α, so the scale is sd-scripts' per-projection α / r, and the saved file means
    the same to every loader (which reads rank n·r).
    """

    def __init__(self, lora_name: str, org_modules: list[nn.Module], multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: Optional[Union[float, torch.Tensor]] = 1.0, dropout: Optional[float] = None,
                 rank_dropout: Optional[float] = None, module_dropout: Optional[float] = None, split: bool = False):
        super().__init__()
        if not org_modules or not all(isinstance(m, nn.Linear) for m in org_modules):
            raise TypeError(f"{lora_name}: a fused LoRA needs Linear modules")
        in_features = {m.in_features for m in org_modules}
        if len(in_features) != 1:
            raise ValueError(f"{lora_name}: fused projections must share their input size, got {sorted(in_features)}")
        if split and lora_dim % len(org_modules):
            raise ValueError(f"{lora_name}: a split LoRA's rank {lora_dim} is not a multiple of {len(org_modules)}")
        self.lora_name = lora_name
        self.lora_dim = lora_dim
        self.split = split
        self.out_sizes = [m.out_features for m in org_modules]
        device = org_modules[0].weight.device
        self.lora_down = nn.Linear(in_features.pop(), lora_dim, bias=False, device=device)
        self.lora_up = nn.Linear(lora_dim, sum(self.out_sizes), bias=False, device=device)
        init_lora_parameters(self, lora_dim, alpha, multiplier, dropout, rank_dropout, module_dropout, device)
        self._orgs: tuple[nn.Module, ...] = tuple(org_modules)  # outside the module tree: not in state_dict
        self._org_forwards: Optional[list] = None
        self._had_own_forward: list[bool] = []
        self._cache: Optional[tuple] = None  # (input, grad mode, shared down output, slices left)
        self.fused_matmul = False  # each slice's update added into its projection's output (use_fused_lora)

    @property
    def org_module(self) -> nn.Module:
        return self._orgs[0]

    @property
    def org_modules(self) -> tuple[nn.Module, ...]:
        return self._orgs

    def apply_to(self) -> None:
        """Route every original projection's forward through its slice of this LoRA."""
        if self._org_forwards is not None:
            return
        self._had_own_forward = ["forward" in m.__dict__ for m in self._orgs]
        self._org_forwards = [m.forward for m in self._orgs]
        for i, module in enumerate(self._orgs):
            module.forward = self._slice_forward_fn(i)

    def _slice_forward_fn(self, index: int):
        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return self.slice_forward(index, x, *args, **kwargs)

        return forward

    def restore(self) -> None:
        """Give every original projection its own forward back."""
        if self._org_forwards is None:
            return
        for module, own, fwd in zip(self._orgs, self._had_own_forward, self._org_forwards):
            if own:
                module.forward = fwd
            else:
                del module.forward
        self._org_forwards = None
        self._cache = None

    def refresh_scale(self) -> None:
        """Recompute the scale from the `alpha` buffer (after loading weights)."""
        self.scale = lora_math.lora_scale(self.alpha, self.lora_dim)

    def _shared_down(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], float]:
        """down(x) (after dropouts) and the scale, computed once for the projections that share x."""
        grad = torch.is_grad_enabled()
        if self._cache is not None and self._cache[0] is x and self._cache[1] == grad:
            _, _, lx, scale, left = self._cache
            self._cache = None if left <= 1 else (x, grad, lx, scale, left - 1)
            return lx, scale
        scale = self.scale
        if self.training and self.module_dropout is not None and torch.rand(1) < self.module_dropout:
            lx = None
        else:
            lx = self.lora_down(x.to(self.lora_down.weight.dtype))
            if self.training and self.dropout is not None:
                lx = F.dropout(lx, p=self.dropout)
            if self.training and self.rank_dropout is not None:
                mask = torch.rand((lx.size(0), self.lora_dim), device=lx.device) > self.rank_dropout
                lx = lx * mask.reshape(lx.size(0), *([1] * (lx.dim() - 2)), self.lora_dim).to(lx.dtype)
                scale = scale / (1.0 - self.rank_dropout)
        left = len(self._orgs) - 1
        self._cache = (x, grad, lx, scale, left) if left > 0 else None
        return lx, scale

    def _adds_in_place(self, index: int, org_out: torch.Tensor) -> bool:
        """Whether projection `index`'s update may be added into its output in place (lora_matmul's rule), with no
        GGPO perturbation to add after it."""
        return (self.fused_matmul and not (self.training and self.ggpo is not None and self.ggpo.active())
                and org_out.is_contiguous()
                and takes_update_in_place(self._orgs[index], self._had_own_forward[index], org_out))

    def slice_forward(self, index: int, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Output of original projection `index` plus its LoRA slice."""
        org_out = self._org_forwards[index](x, *args, **kwargs)
        lx, scale = self._shared_down(x)
        if lx is None:
            return org_out
        start = sum(self.out_sizes[:index])
        up = self.lora_up.weight[start:start + self.out_sizes[index]]
        if self.split:  # its own rank block only: the rest of the row is never read, so never trained
            rank = self.lora_dim // len(self._orgs)
            lx, up = lx[..., index * rank:(index + 1) * rank], up[:, index * rank:(index + 1) * rank]
        if self._adds_in_place(index, org_out):  # the same sum without the scaled copy (networks/lora_matmul.py)
            return add_scaled(org_out.view(-1, org_out.shape[-1]), lx.reshape(-1, lx.shape[-1]), up.t(),
                              self.multiplier * scale).view(org_out.shape)
        out = org_out + (F.linear(lx, up) * (self.multiplier * scale)).to(org_out.dtype)
        if self.training and self.ggpo is not None and self.ggpo.active():
            out = out + self.ggpo.perturbation(x, out.dtype, start, start + self.out_sizes[index])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fused update alone: (up @ down)(x) · multiplier · scale, all slices concatenated."""
        return self.lora_up(self.lora_down(x)) * (self.multiplier * self.scale)

    def delta_weight(self) -> torch.Tensor:
        """ΔW of the fused layer [sum(out), in] at multiplier 1 (float32)."""
        return lora_math.delta_weight(self.lora_down.weight.float(), self.lora_up.weight.float(), self.alpha)

    def delta_weights(self) -> list[torch.Tensor]:
        """ΔW of each original projection, in order."""
        return list(torch.split(self.delta_weight(), self.out_sizes, dim=0))

    @torch.no_grad()
    def merge_weights(self, down: torch.Tensor, up: torch.Tensor, alpha: Optional[torch.Tensor], multiplier: float,
                      dtype: Optional[torch.dtype] = None, device: Optional[Union[str, torch.device]] = None) -> None:
        """Add multiplier · ΔW (of the given fused tensors) into each original projection's weight."""
        for module, up_slice in zip(self._orgs, torch.split(up, self.out_sizes, dim=0)):
            weight = module.weight
            merged = lora_math.merge_into(weight.data, down, up_slice, alpha, multiplier)
            weight.data = merged.to(device=device or weight.device, dtype=dtype or weight.dtype)
