"""--fused_backward_pass: each parameter is clipped, stepped and its gradient freed as soon as backward
has finished accumulating it, so the gradients of the whole model are never held at once.

`FusedBackwardOptimizer` is a torch Optimizer over the same parameter groups as the one the run
asked for (so LR schedulers, logging and accelerate see the usual object), but the work is done by
one inner optimizer of the requested type per parameter, called from that parameter's
post-accumulate-grad hook with the group's current learning rate. Any optimizer works (AdamW and its
8-bit / schedule-free relatives, Adafactor, Lion, ...). Clipping is per parameter (sd-scripts does
the same: the global norm is not known until every gradient is gone).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class FusedBackwardOptimizer(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict], make_inner: Callable[[list[dict]], torch.optim.Optimizer],
                 max_grad_norm: Optional[float] = None):
        super().__init__(param_groups, defaults={})
        self.max_grad_norm = max_grad_norm
        self.params_in_order: list[torch.nn.Parameter] = []
        self.inner: dict[int, tuple[torch.optim.Optimizer, dict]] = {}
        self.handles = []
        for group in self.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.inner[id(p)] = (make_inner([{**settings, "params": [p]}]), group)
                self.params_in_order.append(p)
                self.handles.append(p.register_post_accumulate_grad_hook(self._step_parameter))

    @torch.no_grad()
    def _step_parameter(self, p: torch.nn.Parameter) -> None:
        inner, group = self.inner[id(p)]
        if group.get("lr") is not None:
            for g in inner.param_groups:
                g["lr"] = group["lr"]
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p], self.max_grad_norm)
        inner.step()
        p.grad = None

    def step(self, closure=None):  # every parameter was stepped during backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params_in_order:
            p.grad = None

    def state_dict(self) -> dict:
        return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "inner": [self.inner[id(p)][0].state_dict() for p in self.params_in_order]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("inner", [])) != len(self.params_in_order):
            raise ValueError(f"fused optimizer state has {len(state.get('inner', []))} parameters, "
                             f"this run {len(self.params_in_order)}")
        for group, saved in zip(self.param_groups, state["groups"]):
            group.update(saved)
        for p, saved in zip(self.params_in_order, state["inner"]):
            self.inner[id(p)][0].load_state_dict(saved)

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
