"""FSDP2 (PyTorch's `fully_shard`, per-parameter DTensor sharding): sharding a part's units and its root, and how a
trainable sharded so gathers its weights and saves / loads a whole state. library/train/distributed/sharding.py decides what
is sharded and reads the settings.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch


def shard(module: torch.nn.Module, found: list[torch.nn.Module], s, param_dtype: Optional[torch.dtype] = None,
          checkpoint_units: bool = False) -> int:
    """fully_shard `module`'s units `found` (innermost first), then `module` itself, in place, with the FsdpSettings
    `s`; returns the number of units. With
    `checkpoint_units` each unit's activations are recomputed in backward (torch's composable `checkpoint`,
    FSDP activation checkpointing) instead of kept."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {"reshard_after_forward": s.reshard_after_forward,
              "offload_policy": CPUOffloadPolicy() if s.cpu_offload else OffloadPolicy()}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for unit in found:
        if checkpoint_units:
            checkpoint(unit)
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
    return len(found)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer


@contextlib.contextmanager
def dtensors_whole(module: torch.nn.Module, keep: bool, whole: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Iterator[None]:
    """Inside, each DTensor parameter of `module` is the plain tensor `whole(p)` where `keep`; every process must
    enter (`whole` gathers, a collective each call). The DTensors come back on exit (FSDP2 and tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    swapped = []
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or not isinstance(p, DTensor):
                    continue
                full = whole(p)
                if keep:
                    sub._parameters[name] = torch.nn.Parameter(full, requires_grad=False)
                    swapped.append((sub, name, p))
                del full
    try:
        yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p


class Fsdp2:
    """How a trainable sharded by `fully_shard` gathers its weights and state (library/train/adapters/trainables.py)."""

    @staticmethod
    def gathered(module: torch.nn.Module, keep: bool):
        """Inside, `module`'s sharded parameters are whole tensors where `keep` (the process that saves); every
        process must enter (each parameter is all-gathered in turn). The shards come back on exit."""
        return dtensors_whole(module, keep, lambda p: p.full_tensor())

    @staticmethod
    def full_state(module: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """(whole weights, whole optimizer state) on the CPU for a state folder; every process must call it. The
        optimizer state is keyed by parameter name (PyTorch's full state dict), so it loads back whatever the
        sharding."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(module, _torch_optimizer(optimizer), options=options)

    @staticmethod
    def load_full_state(module: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor],
                        optimizer_state: dict) -> None:
        """Shard a state folder's whole weights and optimizer state back into `module` / `optimizer` (every
        process)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(module, _torch_optimizer(optimizer), model_state_dict=weights,
                       optim_state_dict=optimizer_state, options=StateDictOptions(full_state_dict=True))
