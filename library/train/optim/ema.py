"""An exponential moving average of the trained weights (--use_ema), for full fine-tunes and adapters alike.

ema <- decay_t * ema + (1 - decay_t) * weights, every --ema_update_every optimizer steps from
--ema_start_step on (the average starts as a copy of the weights then). With warm-up, decay_t is
min(decay, (1 + t) / (10 + t)) at the t-th update, so early averages are not dominated by the
initial weights. The averages live in float32 on the CPU (--ema_device cpu) or beside the weights.
Under FSDP2 each process averages its own shard of every weight (the EMA is sharded as the weights are);
`state()` and `load_state()` then gather and shard whole tensors, and every process must call them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass
class EmaOptions:
    """An exponential moving average of the trained weights (full fine-tunes and adapters alike)."""
    use_ema: bool = False
    decay: float = 0.9999
    warmup: bool = True  # decay_t = min(decay, (1 + t) / (10 + t)) over the t-th update
    update_every: int = 1
    device: str = "cpu"  # "cpu" or "same" (the training device)
    start_step: int = 0
    save_ema_only: bool = True  # False: also save the trained weights as <name>-nonema
    for_sampling: bool = True
    for_validation: bool = True


class EMA:
    """The moving averages of a module's trainable parameters, keyed by parameter name."""

    def __init__(self, module: nn.Module, opts: EmaOptions, device: torch.device):
        self.opts = opts
        self.device = torch.device("cpu") if opts.device == "cpu" else torch.device(device)
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.shadow: dict[str, torch.Tensor] = {}
        self.updates = 0

    def decay(self) -> float:
        if not self.opts.warmup:
            return self.opts.decay
        return min(self.opts.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def step(self, global_step: int) -> None:
        """Called after optimizer step `global_step` (1-based)."""
        if global_step < self.opts.start_step:
            return
        if not self.shadow:
            self.shadow = {n: _local(p).detach().to(self.device, torch.float32, copy=True)
                           for n, p in self.params.items()}
            return
        if (global_step - self.opts.start_step) % self.opts.update_every:
            return
        d = self.decay()
        for name, p in self.params.items():
            self.shadow[name].lerp_(_local(p).detach().to(self.device, torch.float32), 1.0 - d)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in place of the trained ones inside the block (nothing before the first step)."""
        if not self.shadow:
            yield
            return
        backup = {}
        with torch.no_grad():
            for name, p in self.params.items():
                local = _local(p)
                backup[name] = local.detach().to("cpu", copy=True)
                local.copy_(self.shadow[name].to(local.device, local.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    local = _local(p)
                    local.copy_(backup[name].to(local.device))

    def state(self) -> Optional[dict[str, torch.Tensor]]:
        """The averages and the update count, for the state folder (None before the first step)."""
        if not self.shadow:
            return None
        whole = {n: _whole(self.shadow[n], p) for n, p in self.params.items()}
        return {**whole, "__ema_updates__": torch.tensor(self.updates, dtype=torch.int64)}

    def load_state(self, state: Optional[dict[str, torch.Tensor]]) -> None:
        if not state:
            return
        state = dict(state)
        self.updates = int(state.pop("__ema_updates__"))
        self.shadow = {n: _shard_like(state[n], p).to(self.device, torch.float32) for n, p in self.params.items()}


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's part of a weight: the shard of an FSDP2 (DTensor) parameter, else the weight itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def _whole(shard: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole average of a weight from every process's shard (collective under FSDP2)."""
    if not isinstance(p, DTensor):
        return shard
    local = DTensor.from_local(shard.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local.full_tensor().cpu()


def _shard_like(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This process's shard of a whole average, cut as FSDP2 cuts `p` (collective under FSDP2)."""
    if not isinstance(p, DTensor):
        return whole
    return distribute_tensor(whole.to(p.device, torch.float32), p.device_mesh, p.placements).to_local()
