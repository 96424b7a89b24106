"""FSDP2 (PyTorch's `fully_shard`) for full fine-tunes, configured the way accelerate configures it.

`accelerate launch --config_file <fsdp2 config>` (tools/make_accelerate_config.py) passes the FSDP options to
every process as `ACCELERATE_USE_FSDP` / `FSDP_*` environment variables; `FsdpSettings.from_env` reads them
(a `torchrun` launch can set them by hand). The loop then shards each trained part itself with `fully_shard`:
one unit per block of the family's `block_classes` (TRANSFORMER_BASED_WRAP) or per subtree of at least
`FSDP_MIN_NUM_PARAMS` parameters (SIZE_BASED_WRAP), then the part's root. This runs on GPUs (NCCL) and on CPU
processes (gloo), where accelerate itself does not offer FSDP, so the tests run here. Each process then holds
1/N of the trained weights, gradients and optimizer states; forward and backward gather a block's weights
just in time and reduce-scatter its gradients.

Saving gathers the full weights (`full_parameters`): every process takes part in the all-gathers, the main
process writes the same single-file / diffusers model as single-GPU training.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from library.core.errors import ConfigError


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in ("1", "true", "yes")


@dataclass
class FsdpSettings:
    version: int = 2
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    block_classes: tuple[str, ...] = ()  # empty: the family's
    min_num_params: int = 100_000_000

    @staticmethod
    def from_env() -> Optional[FsdpSettings]:
        """The FSDP settings accelerate's launcher exported, or None when FSDP is not asked for."""
        if not _flag("ACCELERATE_USE_FSDP", False):
            return None
        version = int(os.environ.get("FSDP_VERSION", "1"))
        if version != 2:
            raise ConfigError(f"FSDP version {version} (accelerate config fsdp_version): only FSDP2 is implemented "
                              "here; write the config with tools/make_accelerate_config.py --strategy fsdp2")
        classes = tuple(c.strip() for c in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip())
        return FsdpSettings(version, _flag("FSDP_RESHARD_AFTER_FORWARD", True), _flag("FSDP_OFFLOAD_PARAMS", False),
                            os.environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"), classes,
                            int(float(os.environ.get("FSDP_MIN_NUM_PARAMS", "1e8"))))


def fsdp_unsupported(s) -> Optional[str]:
    """Why FSDP2 sharding cannot run these RunSettings yet (refused in one line before anything loads), or None."""
    t = s.training
    if s.fine_tune is None:
        return ("it shards full fine-tunes; a LoRA's own weights are small and its base is frozen: launch with "
                "a DDP config (tools/make_accelerate_config.py --strategy ddp)")
    if t.compile.torch_compile:
        return "--torch_compile is not supported with it yet"
    if s.memory.blocks_to_swap:
        return "--blocks_to_swap is not supported with it (FSDP's CPU offload is the sharded equivalent)"
    return None


def _units(module: torch.nn.Module, s: FsdpSettings, family_classes: tuple[str, ...]) -> list[torch.nn.Module]:
    """The submodules sharded as units of their own, innermost first (fully_shard wants children before parents)."""
    if s.wrap_policy == "SIZE_BASED_WRAP":
        units: list[torch.nn.Module] = []

        def visit(m: torch.nn.Module) -> int:
            """Parameters of `m` not yet in a unit; `m` becomes a unit when they reach the minimum."""
            own = sum(p.numel() for p in m.parameters(recurse=False))
            rest = own + sum(visit(c) for c in m.children())
            if rest >= s.min_num_params and m is not module:
                units.append(m)
                return 0
            return rest

        visit(module)
        return units
    names = set(s.block_classes or family_classes)
    if not names:
        raise ConfigError("FSDP TRANSFORMER_BASED_WRAP: this model family names no block classes; set "
                          "fsdp_transformer_layer_cls_to_wrap or use SIZE_BASED_WRAP")
    return [m for m in module.modules() if type(m).__name__ in names and m is not module][::-1]


def shard(module: torch.nn.Module, s: FsdpSettings, family_classes: tuple[str, ...],
          param_dtype: Optional[torch.dtype] = None) -> int:
    """fully_shard `module`'s units, then `module` itself, in place; returns the number of units."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {"reshard_after_forward": s.reshard_after_forward,
              "offload_policy": CPUOffloadPolicy() if s.cpu_offload else OffloadPolicy()}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    units = _units(module, s, family_classes)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
    return len(units)


@contextlib.contextmanager
def full_parameters(module: torch.nn.Module, keep: bool) -> Iterator[None]:
    """Inside, `module`'s sharded parameters are whole tensors where `keep` (the process that saves); every
    process must enter (each parameter is all-gathered in turn). The shards come back on exit."""
    from torch.distributed.tensor import DTensor

    swapped = []
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or not isinstance(p, DTensor):
                    continue
                full = p.full_tensor()
                if keep:
                    sub._parameters[name] = torch.nn.Parameter(full, requires_grad=False)
                    swapped.append((sub, name, p))
                del full
    try:
        yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer


def full_state(module: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(whole weights, whole optimizer state) on the CPU for a state folder; every process must call it. The
    optimizer state is keyed by parameter name (PyTorch's full state dict), so it loads back whatever the sharding."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(module, _torch_optimizer(optimizer), options=options)


def load_full_state(module: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor], optimizer_state: dict) -> None:
    """Shard a state folder's whole weights and optimizer state back into `module` / `optimizer` (every process)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(module, _torch_optimizer(optimizer), model_state_dict=weights, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))
