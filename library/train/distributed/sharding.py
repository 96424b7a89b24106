"""FSDP (PyTorch's FSDP2 `fully_shard`, or FSDP1 `FullyShardedDataParallel`) for full fine-tunes and LoRA,
configured the way accelerate configures it.

`accelerate launch --config_file <fsdp config>` (tools/make_accelerate_config.py) passes the FSDP options to
every process as `ACCELERATE_USE_FSDP` / `FSDP_*` environment variables; `FsdpSettings.from_env` reads them
(a `torchrun` launch can set them by hand). The loop then shards each trained part itself: one unit per block of
the family's `block_classes` (TRANSFORMER_BASED_WRAP) or per subtree of at least `FSDP_MIN_NUM_PARAMS`
parameters (SIZE_BASED_WRAP), then the part's root. This runs on GPUs (NCCL) and on CPU processes (gloo), where
accelerate itself does not offer FSDP, so the tests run here. Each process then holds 1/N of the sharded
weights, gradients and optimizer states; forward and backward gather a block's weights just in time and
reduce-scatter its gradients.

With a LoRA the frozen base is what is large: the parts the adapter hooks into (the denoiser, a trained text
encoder) are sharded, and each LoRA module is registered inside the unit that holds the layer it hooks
(`attach_adapters`), so a block's gather brings its frozen weights and its LoRA weights together and only the
LoRA's gradients are reduce-scattered. Its saved file is the one single-process training writes.

Saving gathers the full weights (`gathered` of sharding_fsdp2.Fsdp2 / sharding_fsdp1.Fsdp1): every process takes
part in the all-gathers, the main process writes the same file as single-process training. This module reads the
settings, refuses what cannot combine and decides the units; sharding_fsdp2.py and sharding_fsdp1.py shard them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from library.core.errors import ConfigError
from library.train.distributed.sharding_fsdp1 import Fsdp1, leftover_owners
from library.train.distributed.sharding_fsdp2 import Fsdp2, shard

WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")  # 1..5
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
ADAPTERS = "fsdp_adapters"  # the attribute under which a unit holds the LoRA modules hooked into it


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return None if value is None or value.strip() in ("", "None") else value.strip()


def _flag(name: str, default: bool) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ConfigError(f"{name}={value}: expected true or false")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (_env(name) or default).upper()
    if value.isdigit() and name == "FSDP_SHARDING_STRATEGY" and 1 <= int(value) <= len(choices):
        return choices[int(value) - 1]  # accelerate's numbered form of the strategy
    if value not in choices:
        raise ConfigError(f"{name}={value}: expected one of {', '.join(choices)}")
    return value


@dataclass
class FsdpSettings:
    """The FSDP options of the accelerate config (`fsdp_*` keys), as its launcher exports them."""
    version: int = 2
    reshard_after_forward: bool = True  # FSDP2 (FSDP1: sharding_strategy FULL_SHARD vs SHARD_GRAD_OP)
    sharding_strategy: str = "FULL_SHARD"  # FSDP1
    cpu_offload: bool = False
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    block_classes: tuple[str, ...] = ()  # empty: the family's
    min_num_params: int = 100_000_000
    activation_checkpointing: bool = False
    cpu_ram_efficient_loading: bool = False  # rank 0 loads the weights, the others receive them
    sync_module_states: bool = False
    backward_prefetch: str = "BACKWARD_PRE"  # FSDP1
    forward_prefetch: bool = False  # FSDP1
    use_orig_params: bool = True  # FSDP1
    limit_all_gathers: bool = True  # FSDP1
    state_dict_type: str = "FULL_STATE_DICT"  # what --save_state writes

    @staticmethod
    def from_env() -> Optional[FsdpSettings]:
        """The FSDP settings accelerate's launcher exported, or None when FSDP is not asked for. A value that is
        not one of the names accelerate writes is refused in one line naming the variable."""
        if not _flag("ACCELERATE_USE_FSDP", False):
            return None
        version = _env("FSDP_VERSION") or "1"
        if version not in ("1", "2"):
            raise ConfigError(f"FSDP_VERSION={version} (accelerate config fsdp_version): expected 1 or 2")
        strategy = _choice("FSDP_SHARDING_STRATEGY", "FULL_SHARD", SHARDING_STRATEGIES)
        reshard = _env("FSDP_RESHARD_AFTER_FORWARD")
        if version == "1" and _env("FSDP_SHARDING_STRATEGY") is None and reshard and reshard.upper() in \
                SHARDING_STRATEGIES:  # accelerate's FSDP1 fallback spells the strategy there
            strategy = reshard.upper()
        reshard_after_forward = _flag("FSDP_RESHARD_AFTER_FORWARD", True) if version == "2" else \
            strategy != "SHARD_GRAD_OP"
        classes = tuple(c.strip() for c in (_env("FSDP_TRANSFORMER_CLS_TO_WRAP") or "").split(",") if c.strip())
        min_params = _env("FSDP_MIN_NUM_PARAMS") or "1e8"
        try:
            min_num_params = int(float(min_params))
        except ValueError:
            raise ConfigError(f"FSDP_MIN_NUM_PARAMS={min_params}: expected a number of parameters") from None
        ram_efficient = _flag("FSDP_CPU_RAM_EFFICIENT_LOADING", False)
        return FsdpSettings(
            version=int(version), reshard_after_forward=reshard_after_forward, sharding_strategy=strategy,
            cpu_offload=_flag("FSDP_OFFLOAD_PARAMS", False),
            wrap_policy=_choice("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP", WRAP_POLICIES),
            block_classes=classes, min_num_params=min_num_params,
            activation_checkpointing=_flag("FSDP_ACTIVATION_CHECKPOINTING", False),
            cpu_ram_efficient_loading=ram_efficient,
            sync_module_states=_flag("FSDP_SYNC_MODULE_STATES", ram_efficient),
            backward_prefetch=_choice("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE", BACKWARD_PREFETCH),
            forward_prefetch=_flag("FSDP_FORWARD_PREFETCH", False),
            use_orig_params=_flag("FSDP_USE_ORIG_PARAMS", True),
            limit_all_gathers=_flag("FSDP_LIMIT_ALL_GATHERS", True),
            state_dict_type=_choice("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT", STATE_DICT_TYPES))


def fsdp_unsupported(s, fsdp: FsdpSettings) -> Optional[str]:
    """Why FSDP cannot run these RunSettings with these FSDP settings (refused in one line before anything
    loads), or None."""
    t = s.training
    if s.fine_tune is None:
        if not getattr(s.network_kind, "own", False):
            return (f"--network_module {s.network.network_module}: only networks.lora (and its per-family names) "
                    "is sharded; launch other networks with a DDP config (tools/make_accelerate_config.py "
                    "--strategy ddp)")
        if s.network.scale_weight_norms:
            return "--scale_weight_norms is not supported with it (it rescales whole LoRA weights every step)"
        if fsdp.version == 1 and not fsdp.use_orig_params:
            return ("fsdp_use_orig_params false: a LoRA needs it on (frozen base weights and trained LoRA weights "
                    "share a block)")
    if fsdp.version == 1 and not fsdp.use_orig_params:
        return ("fsdp_use_orig_params false: FSDP1 runs here with it on (saving reads the original parameters; "
                "a LoRA's frozen and trained weights share a block)")
    if fsdp.version == 1 and s.ema.use_ema:
        return "--use_ema: with FSDP2 only (fsdp_version 2 averages each process's shard)"
    if fsdp.state_dict_type != "FULL_STATE_DICT":
        return (f"fsdp_state_dict_type {fsdp.state_dict_type}: --save_state writes whole weights gathered on rank 0 "
                "(FULL_STATE_DICT) only")
    if t.compile.torch_compile and fsdp.version == 1:
        return "--torch_compile: with FSDP2 only (fsdp_version 2 compiles the blocks after sharding them)"
    if fsdp.cpu_ram_efficient_loading:
        return ("fsdp_cpu_ram_efficient_loading: not supported (the model families load whole weights on every "
                "process; they cannot build on the meta device yet); set it false")
    if {s.memory.base_model_precision, s.memory.text_encoder_precision} != {"no_change"}:
        return "--base_model_precision / --text_encoder_precision: quantized weights are not sharded; use a DDP config"
    model = getattr(getattr(s, "model", None), "pretrained_model_name_or_path", None)
    if isinstance(model, str) and model.lower().endswith(".gguf"):
        return (f"--pretrained_model_name_or_path {model}: a GGUF file's quantized weights are not sharded; "
                "use a DDP config")
    if s.memory.blocks_to_swap:
        return "--blocks_to_swap is not supported with it (FSDP's CPU offload is the sharded equivalent)"
    return None


def units(module: torch.nn.Module, s: FsdpSettings, family_classes: tuple[str, ...]) -> list[torch.nn.Module]:
    """The submodules sharded as units of their own, innermost first (FSDP wants children before parents)."""
    if s.wrap_policy == "NO_WRAP":
        return []
    if s.wrap_policy == "SIZE_BASED_WRAP":
        found: list[torch.nn.Module] = []

        def visit(m: torch.nn.Module) -> int:
            """Parameters of `m` not yet in a unit; `m` becomes a unit when they reach the minimum."""
            own = sum(p.numel() for p in m.parameters(recurse=False))
            rest = own + sum(visit(c) for c in m.children())
            if rest >= s.min_num_params and m is not module:
                found.append(m)
                return 0
            return rest

        visit(module)
        return found
    names = set(s.block_classes or family_classes)
    if not names:
        raise ConfigError("FSDP TRANSFORMER_BASED_WRAP: this model family names no block classes; set "
                          "fsdp_transformer_layer_cls_to_wrap or use SIZE_BASED_WRAP")
    return [m for m in module.modules() if type(m).__name__ in names and m is not module][::-1]


def adapter_modules(network: torch.nn.Module) -> list[torch.nn.Module]:
    """The LoRA modules of a network (those hooked into a model layer: `org_module`)."""
    return [m for m in network.modules() if m is not network and (hasattr(m, "_org") or hasattr(m, "_orgs"))]


def attach_adapters(network: torch.nn.Module, parts: dict[str, torch.nn.Module],
                    part_units: dict[str, list[torch.nn.Module]]) -> dict[str, int]:
    """Register each LoRA module of `network` inside the innermost unit (else the part) holding the layer it hooks,
    so that FSDP shards and gathers it with that layer's block. Returns {part: LoRA modules attached}; a part no
    LoRA hooks into is left out. Module names are unchanged in the network (saving reads the network)."""
    owner_of: dict[int, torch.nn.Module] = {}
    part_of: dict[int, str] = {}
    for name, part in parts.items():
        for m in part.modules():
            part_of[id(m)] = name
            owner_of.setdefault(id(m), part)
        for unit in part_units.get(name, []):  # innermost first: an inner unit claims its layers first
            for m in unit.modules():
                if owner_of[id(m)] is part:
                    owner_of[id(m)] = unit
    counts: dict[str, int] = {}
    for lora in adapter_modules(network):
        org = lora.org_module
        if id(org) not in owner_of:
            raise ConfigError(f"FSDP: LoRA module {getattr(lora, 'lora_name', type(lora).__name__)} hooks a layer "
                              "outside the sharded parts")
        owner = owner_of[id(org)]
        holder = getattr(owner, ADAPTERS, None)
        if holder is None:
            holder = torch.nn.ModuleDict()
            owner.add_module(ADAPTERS, holder)
        holder[str(len(holder))] = lora
        counts[part_of[id(org)]] = counts.get(part_of[id(org)], 0) + 1
    return counts


@contextlib.contextmanager
def sync_done_here(s: Optional[FsdpSettings]) -> Iterator[None]:
    """While accelerate builds its Accelerator: FSDP_SYNC_MODULE_STATES hidden from its FSDP plugin, which refuses
    it without a GPU although it never wraps a model here (`broadcast_module_states` does the sync)."""
    name = "FSDP_SYNC_MODULE_STATES"
    saved = os.environ.pop(name, None) if s is not None else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def broadcast_module_states(modules: list[torch.nn.Module]) -> int:
    """fsdp_sync_module_states: every parameter and buffer of `modules` takes rank 0's values (every process calls
    it, before sharding); returns how many tensors were sent."""
    import torch.distributed as dist

    sent = 0
    with torch.no_grad():
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)
                sent += 1
    return sent


def shard_parts(parts: dict[str, torch.nn.Module], s: FsdpSettings, family_classes: tuple[str, ...],
                adapters: Optional[torch.nn.Module] = None, checkpointed: frozenset[str] = frozenset(),
                device: Optional[torch.device] = None):
    """Shard a run's trained parts in place ({"denoiser": ..., "text_encoder1": ...}); with `adapters` (a LoRA
    network) the parts are the frozen models it hooks into and its modules are sharded inside them. With
    activation checkpointing the block units of every part not in `checkpointed` (parts whose own gradient
    checkpointing is on: --gradient_checkpointing) are checkpointed. Returns how the trainable gathers (`Fsdp2`,
    or sharding_fsdp1's `Fsdp1`) and {part: units sharded} for the log."""
    from torch.distributed._composable import checkpoint


    part_units = {name: units(part, s, family_classes) for name, part in parts.items()}
    blocks = {name: list(found) for name, found in part_units.items()}
    if s.version == 1:  # FSDP1 has no root unit: every module with parameters outside the blocks is one
        part_units = {name: found + leftover_owners(parts[name], found) for name, found in part_units.items()}
    if adapters is not None:
        attached = attach_adapters(adapters, parts, part_units)
        parts = {name: part for name, part in parts.items() if name in attached}
    if s.version == 1:
        sharding = Fsdp1(device or torch.device("cpu"))
        for name, part in parts.items():
            if s.activation_checkpointing and name not in checkpointed:
                for block in blocks[name]:
                    checkpoint(block)
            sharding.wrap(part, part_units[name], s)
        return sharding, {name: len(part_units[name]) for name in parts}
    for name, part in parts.items():
        shard(part, part_units[name], s, checkpoint_units=s.activation_checkpointing and name not in checkpointed)
    return Fsdp2(), {name: len(part_units[name]) for name in parts}
