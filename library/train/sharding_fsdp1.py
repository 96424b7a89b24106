"""FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`, flat parameters) with the knobs of an accelerate
`fsdp_version: 1` config: sharding strategy, CPU offload, backward / forward prefetch, limit_all_gathers, the
wrap policy. `use_orig_params` is always on here: a LoRA's frozen base weights and trained LoRA weights share
a block, and saving reads the original parameters.

The units are wrapped in place (each replaced in its parent by its FullyShardedDataParallel), so the families keep
calling their models as before: the family's blocks (TRANSFORMER_BASED_WRAP) or subtrees of at least
`min_num_params` parameters (SIZE_BASED_WRAP), and then every module outside those units that holds parameters
of its own (a UNet's conv_in, time embedding, norms), which FSDP1 has no root unit for. Runs on CPU processes
(gloo) as on GPUs; PyTorch's own `sync_module_states` needs GPUs, so states are broadcast by
`sharding.broadcast_module_states` before wrapping instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from library.core.errors import ConfigError


def leftover_owners(part: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Modules of `part` outside every unit that hold parameters of their own (FSDP1 wraps each)."""
    inside = {id(m) for u in units for m in u.modules()}
    out = []
    for m in part.modules():
        if id(m) in inside or not any(True for _ in m.parameters(recurse=False)):
            continue
        if m is part:
            raise ConfigError(f"FSDP1: {type(part).__name__} holds parameters of its own outside its blocks; use "
                              "fsdp_version 2")
        out.append(m)
    return out


class Fsdp1:
    """The FullyShardedDataParallel units of a run and how the trainable gathers its weights through them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.wrapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (parent, name, wrapper)

    def wrap(self, part: torch.nn.Module, units: list[torch.nn.Module], s) -> int:
        """Replace each unit of `part` (innermost first) in its parent by its FullyShardedDataParallel."""
        from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        parent_of = {id(child): (m, name) for m in part.modules() for name, child in m.named_children()}
        prefetch = None if s.backward_prefetch == "NO_PREFETCH" else BackwardPrefetch[s.backward_prefetch]
        kwargs = dict(sharding_strategy=ShardingStrategy[s.sharding_strategy],
                      cpu_offload=CPUOffload(offload_params=s.cpu_offload), backward_prefetch=prefetch,
                      forward_prefetch=s.forward_prefetch, limit_all_gathers=s.limit_all_gathers, use_orig_params=True,
                      device_id=self.device)
        for unit in units:
            parent, name = parent_of[id(unit)]
            wrapper = FSDP(unit, **kwargs)
            setattr(parent, name, wrapper)
            parent_of[id(wrapper)] = (parent, name)
            self.wrapped.append((parent, name, wrapper))
        return len(units)

    @contextlib.contextmanager
    def _unwrapped(self) -> Iterator[None]:
        """The original modules back in their parents (their parameters as FSDP left them), outermost last."""
        for parent, name, wrapper in reversed(self.wrapped):
            setattr(parent, name, wrapper.module)
        try:
            yield
        finally:
            for parent, name, wrapper in self.wrapped:
                setattr(parent, name, wrapper)

    @contextlib.contextmanager
    def gathered(self, module: torch.nn.Module, keep: bool) -> Iterator[None]:
        """Inside, the original parameters hold the whole weights (every process must enter) and the module tree
        is the original one, so state_dict() has the original names and gathers nothing itself."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with contextlib.ExitStack() as stack:
            for _, _, wrapper in self.wrapped:  # nested units are summoned by their outermost wrapper's call
                stack.enter_context(FSDP.summon_full_params(wrapper, writeback=False, recurse=False))
            stack.enter_context(self._unwrapped())
            yield

    def full_state(self, module: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """(whole weights, whole optimizer state keyed by parameter name) for a state folder (FULL_STATE_DICT);
        every process must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=self.device.type == "cuda")
        weights, optim = get_state_dict(module, getattr(optimizer, "optimizer", optimizer), options=options)
        return {k: v.detach().cpu() for k, v in weights.items()}, optim

    def load_full_state(self, module: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor],
                        optimizer_state: dict) -> None:
        """A state folder's whole weights and optimizer state, sharded back (every process)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(module, getattr(optimizer, "optimizer", optimizer), model_state_dict=weights,
                       optim_state_dict=optimizer_state, options=StateDictOptions(full_state_dict=True))
