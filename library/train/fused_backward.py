"""--fused_backward_pass: each parameter is clipped, stepped and its gradient freed as soon as backward
has finished accumulating it, so the gradients of the whole model are never held at once.

--fused_optimizer_groups N: the same with N chunks of parameters instead of one per parameter.

--blockwise_fused_optimizers (FLUX.1): the same with one chunk per model block, as the family groups them
(`ModelFamily.optimizer_block`): each block's optimizer steps once its last gradient is in.

`FusedBackwardOptimizer` is a torch Optimizer over the same parameter groups as the one the run
asked for (so LR schedulers, logging and accelerate see the usual object), but the work is done by
one inner optimizer of the requested type per parameter, called from that parameter's
post-accumulate-grad hook with the group's current learning rate. Any optimizer works (AdamW and its
8-bit / schedule-free relatives, Adafactor, Lion, ...). Clipping is per parameter (sd-scripts does
the same: the global norm is not known until every gradient is gone).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch


class FusedBackwardOptimizer(torch.optim.Optimizer):
    """`num_chunks` None: one inner optimizer per parameter (--fused_backward_pass). A number N: the parameters,
    in order, are cut into N chunks of about equal size, each with one inner optimizer that steps once all of
    its gradients are in (--fused_optimizer_groups N: at most one chunk's gradients are held at a time).
    `block_of` ({id(parameter): block name}): one chunk per block instead, in order of first appearance
    (--blockwise_fused_optimizers); `chunk_names` lists them."""

    def __init__(self, param_groups: list[dict], make_inner: Callable[[list[dict]], torch.optim.Optimizer],
                 max_grad_norm: Optional[float] = None, num_chunks: Optional[int] = None,
                 block_of: Optional[Mapping[int, str]] = None):
        super().__init__(param_groups, defaults={})
        self.max_grad_norm = max_grad_norm
        members = [(p, group) for group in self.param_groups for p in group["params"]]
        self.params_in_order: list[torch.nn.Parameter] = [p for p, _ in members]
        if block_of is not None:
            by_block: dict[str, list] = {}
            for p, group in members:
                by_block.setdefault(block_of[id(p)], []).append((p, group))
            self.chunk_names = list(by_block)
            chunks = list(by_block.values())
        else:
            chunks = [[m] for m in members] if not num_chunks else _balanced_chunks(members, num_chunks)
            self.chunk_names = [str(i) for i in range(len(chunks))]
        self.chunks: list[tuple[torch.optim.Optimizer, list[tuple[torch.nn.Parameter, dict]]]] = []
        self.chunk_of: dict[int, int] = {}
        self.pending: list[int] = []
        self.handles = []
        for index, chunk in enumerate(chunks):
            inner_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [p]} for p, group in chunk]
            self.chunks.append((make_inner(inner_groups), chunk))
            self.pending.append(len(chunk))
            for p, _ in chunk:
                self.chunk_of[id(p)] = index
                self.handles.append(p.register_post_accumulate_grad_hook(self._gradient_ready))

    @torch.no_grad()
    def _gradient_ready(self, p: torch.nn.Parameter) -> None:
        index = self.chunk_of[id(p)]
        self.pending[index] -= 1
        if self.pending[index]:
            return
        inner, chunk = self.chunks[index]
        self.pending[index] = len(chunk)
        for inner_group, (_, group) in zip(inner.param_groups, chunk):
            if group.get("lr") is not None:
                inner_group["lr"] = group["lr"]
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_([q for q, _ in chunk], self.max_grad_norm)
        inner.step()
        for q, _ in chunk:
            q.grad = None

    def step(self, closure=None):  # every parameter was stepped during backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params_in_order:
            p.grad = None

    def state_dict(self) -> dict:
        return {"groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "inner": [inner.state_dict() for inner, _ in self.chunks]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("inner", [])) != len(self.chunks):
            raise ValueError(f"fused optimizer state has {len(state.get('inner', []))} optimizers, "
                             f"this run {len(self.chunks)}")
        for group, saved in zip(self.param_groups, state["groups"]):
            group.update(saved)
        for (inner, _), saved in zip(self.chunks, state["inner"]):
            inner.load_state_dict(saved)


def _balanced_chunks(members: list, n: int) -> list[list]:
    """`members` (parameter, group) in order, cut into at most n contiguous chunks of about equal element count."""
    total = sum(p.numel() for p, _ in members)
    chunks, current, size = [], [], 0
    for p, group in members:
        current.append((p, group))
        size += p.numel()
        if size >= total * (len(chunks) + 1) / n and len(chunks) < n - 1:
            chunks.append(current)
            current = []
    if current:
        chunks.append(current)
    return chunks
