"""accelerate config files for each multi-process strategy (tools/make_accelerate_config.py, the web UI).

One `LaunchSettings` (the options the UI's "Multi-GPU Optimization" page lists) becomes the YAML mapping
`accelerate launch --config_file` reads: `single`, `ddp`, `fsdp1`, `fsdp2` or `deepspeed`. Everything is
checked first and a bad combination gets one line naming the option. The FSDP wrap policy's block classes
come from the family (`ModelFamily.block_classes`) unless given. The keys are accelerate's own
(`accelerate config` writes the same ones); tests/test_accelerate_config.py reads every file back through
accelerate's launcher and its FSDP / DeepSpeed plugins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from library.core.errors import ConfigError
from library.core.io_utils import atomic_write_text
from library.families import family_names, get_family

STRATEGIES = ("single", "ddp", "fsdp1", "fsdp2", "deepspeed")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MODES = ("lora", "finetune")

# What each strategy is for, shown by the web UI ("Select a strategy to see details") and in --help.
STRATEGY_HELP = {
    "single": "one process on one device (no config needed; written for completeness)",
    "ddp": "DistributedDataParallel: every GPU holds the whole model and trains on its own batches; "
           "gradients are averaged. The choice for LoRA and for full fine-tunes that fit on one GPU",
    "fsdp1": "FullyShardedDataParallel (flat parameters): weights, gradients and optimizer states are "
             "sharded over the GPUs and gathered block by block; for full fine-tunes that do not fit one GPU",
    "fsdp2": "fully_shard (per-parameter DTensor sharding): FSDP's successor, same memory saving with "
             "simpler semantics (no flat parameters); preferred over fsdp1 on PyTorch >= 2.4",
    "deepspeed": "DeepSpeed ZeRO: stage 1 shards optimizer states, 2 also gradients, 3 also weights; "
                 "optimizer / parameter offload to CPU or NVMe",
}


@dataclass
class LaunchSettings:
    strategy: str = "single"
    num_processes: int = 1
    gpu_ids: Optional[str] = None  # "0,1"; None: all
    mixed_precision: str = "no"
    cpu: bool = False
    family: Optional[str] = None
    mode: str = "lora"  # "lora" (frozen base + adapter) or "finetune"
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    gradient_accumulation_steps: int = 1
    # FSDP (fsdp1 / fsdp2)
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    fsdp_activation_checkpointing: bool = False
    fsdp_cpu_ram_efficient_loading: bool = False
    fsdp_backward_prefetch: Optional[str] = None  # fsdp1: BACKWARD_PRE by default
    fsdp_forward_prefetch: bool = False
    fsdp_use_orig_params: bool = True
    fsdp_limit_all_gathers: bool = True
    fsdp_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    fsdp_transformer_layer_cls: Optional[str] = None  # "A,B"; None: the family's block classes
    fsdp_min_num_params: int = 100_000_000
    # DeepSpeed
    zero_stage: int = 2
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    notes: list[str] = field(default_factory=list)  # what was chosen for the user, shown by the tool


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"--{name}: expected one of {', '.join(map(str, choices))}, got {value!r}")


def check(s: LaunchSettings) -> None:
    """One line naming the first bad option; nothing is written before this passes."""
    _choice("strategy", s.strategy, STRATEGIES)
    _choice("mixed_precision", s.mixed_precision, MIXED_PRECISIONS)
    _choice("mode", s.mode, MODES)
    if s.num_processes < 1:
        raise ConfigError(f"--num_processes: expected an integer >= 1, got {s.num_processes}")
    if s.num_machines < 1 or not 0 <= s.machine_rank < s.num_machines:
        raise ConfigError(f"--machine_rank: expected 0..{s.num_machines - 1} with --num_machines {s.num_machines}, "
                          f"got {s.machine_rank}")
    if s.num_machines > 1 and not (s.main_process_ip and s.main_process_port):
        raise ConfigError("--main_process_ip / --main_process_port: needed with --num_machines > 1 "
                          "(the address of machine 0, reachable from every machine)")
    if s.strategy == "single" and (s.num_processes != 1 or s.num_machines != 1):
        raise ConfigError(f"--strategy single: one process on one machine, got --num_processes {s.num_processes}"
                          f" --num_machines {s.num_machines} (use ddp, fsdp1, fsdp2 or deepspeed)")
    if s.strategy != "single" and s.num_processes * s.num_machines < 2:
        raise ConfigError(f"--strategy {s.strategy}: needs at least 2 processes in all, got --num_processes "
                          f"{s.num_processes} on {s.num_machines} machine(s)")
    if s.num_processes % s.num_machines:
        raise ConfigError(f"--num_processes: the total over all machines, a multiple of --num_machines "
                          f"{s.num_machines}; got {s.num_processes}")
    if s.gpu_ids is not None:
        ids = [x.strip() for x in s.gpu_ids.split(",")]
        if not all(x.isdigit() for x in ids) or len(set(ids)) != len(ids):
            raise ConfigError(f"--gpu_ids: expected distinct GPU indices like 0,1, got {s.gpu_ids!r}")
        if len(ids) != s.num_processes // s.num_machines:
            raise ConfigError(f"--gpu_ids: {len(ids)} GPU(s) listed for {s.num_processes // s.num_machines} "
                              f"process(es) per machine; list one per process")
    if s.cpu and s.strategy == "ddp":
        raise ConfigError("--cpu --strategy ddp: accelerate starts several CPU processes only through MPI (mpirun), "
                          "else it runs one; start CPU processes with torchrun --nproc_per_node N <script> --cpu")
    if s.cpu and s.strategy != "single":
        raise ConfigError(f"--cpu: only with --strategy single (accelerate runs {s.strategy} on GPUs)")
    if s.strategy in ("fsdp1", "fsdp2"):
        _check_fsdp(s)
    elif s.strategy == "deepspeed":
        _choice("zero_stage", s.zero_stage, (1, 2, 3))
        _choice("offload_optimizer_device", s.offload_optimizer_device, OFFLOAD_DEVICES)
        _choice("offload_param_device", s.offload_param_device, OFFLOAD_DEVICES)
        if s.offload_param_device != "none" and s.zero_stage != 3:
            raise ConfigError(f"--offload_param_device {s.offload_param_device}: parameters are sharded (and "
                              f"offloadable) only in ZeRO stage 3, got --zero_stage {s.zero_stage}")


def _check_fsdp(s: LaunchSettings) -> None:
    _choice("fsdp_wrap_policy", s.fsdp_wrap_policy, WRAP_POLICIES)
    if s.fsdp_backward_prefetch is not None:
        _choice("fsdp_backward_prefetch", s.fsdp_backward_prefetch, BACKWARD_PREFETCH)
    if s.strategy == "fsdp2":
        if s.fsdp_forward_prefetch:
            raise ConfigError("--fsdp_forward_prefetch: an FSDP1 option (fsdp2 prefetches the next block itself)")
        if s.fsdp_backward_prefetch not in (None, "BACKWARD_PRE"):
            raise ConfigError(f"--fsdp_backward_prefetch {s.fsdp_backward_prefetch}: FSDP1 only (fsdp2 always "
                              "prefetches before each block's backward)")
    if not s.fsdp_limit_all_gathers:
        raise ConfigError("--fsdp_limit_all_gathers false: accelerate's config has no key for it (FSDP1 always "
                          "limits in-flight all-gathers there; fsdp2 has no such knob)")
    if not s.fsdp_use_orig_params and (s.mode == "lora" or s.strategy == "fsdp2"):
        raise ConfigError("--fsdp_use_orig_params false: needed on with --mode lora (frozen base weights and "
                          "trained adapter weights share blocks) and always with fsdp2")
    if s.fsdp_min_num_params < 1:
        raise ConfigError(f"--fsdp_min_num_params: expected an integer >= 1, got {s.fsdp_min_num_params}")
    if s.fsdp_wrap_policy == "TRANSFORMER_BASED_WRAP" and not s.fsdp_transformer_layer_cls:
        if s.family is None:
            raise ConfigError("--fsdp_wrap_policy TRANSFORMER_BASED_WRAP: give --family (its block classes are "
                              "wrapped) or --fsdp_transformer_layer_cls")
        if s.family not in family_names():
            raise ConfigError(f"--family: expected one of {', '.join(family_names())}, got {s.family!r}")
        classes = get_family(s.family).block_classes
        if not classes:
            raise ConfigError(f"--family {s.family}: declares no block classes; use --fsdp_wrap_policy "
                              "SIZE_BASED_WRAP or --fsdp_transformer_layer_cls")
        s.fsdp_transformer_layer_cls = ",".join(classes)
        s.notes.append(f"wrapping {s.fsdp_transformer_layer_cls} (the {s.family} family's blocks)")


def _distributed_type(s: LaunchSettings) -> str:
    if s.strategy == "single":
        return "NO"
    if s.strategy == "ddp":
        return "MULTI_CPU" if s.cpu else "MULTI_GPU"
    return "FSDP" if s.strategy.startswith("fsdp") else "DEEPSPEED"


def build(s: LaunchSettings) -> dict[str, Any]:
    """The accelerate config mapping for checked settings."""
    check(s)
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": _distributed_type(s),
        "mixed_precision": s.mixed_precision,
        "num_machines": s.num_machines,
        "num_processes": s.num_processes,
        "machine_rank": s.machine_rank,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": s.cpu,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "tpu_env": [],
    }
    if not s.cpu:
        config["gpu_ids"] = s.gpu_ids.replace(" ", "") if s.gpu_ids else "all"
    if s.num_machines > 1:
        config["main_process_ip"] = s.main_process_ip
        config["main_process_port"] = s.main_process_port
    if s.strategy.startswith("fsdp"):
        config["fsdp_config"] = _fsdp_config(s)
    elif s.strategy == "deepspeed":
        ds: dict[str, Any] = {
            "zero_stage": s.zero_stage,
            "offload_optimizer_device": s.offload_optimizer_device,
            "offload_param_device": s.offload_param_device,
            "gradient_accumulation_steps": s.gradient_accumulation_steps,
            "zero3_init_flag": False,
        }
        if s.zero_stage == 3:
            ds["zero3_save_16bit_model"] = True  # rank 0 writes a whole model file, not only ZeRO shards
        config["deepspeed_config"] = ds
    return config


def _fsdp_config(s: LaunchSettings) -> dict[str, Any]:
    version = 2 if s.strategy == "fsdp2" else 1
    out: dict[str, Any] = {
        "fsdp_version": version,
        "fsdp_auto_wrap_policy": s.fsdp_wrap_policy,
        "fsdp_offload_params": s.fsdp_cpu_offload,
        "fsdp_activation_checkpointing": s.fsdp_activation_checkpointing,
        "fsdp_cpu_ram_efficient_loading": s.fsdp_cpu_ram_efficient_loading,
        # rank 0 loads, the others receive its weights: needs the module states synchronised
        "fsdp_sync_module_states": s.fsdp_cpu_ram_efficient_loading,
        "fsdp_use_orig_params": s.fsdp_use_orig_params,
        # saving gathers a full state dict on rank 0: the model / LoRA file is the single-GPU one
        "fsdp_state_dict_type": "FULL_STATE_DICT",
    }
    if version == 1:
        out["fsdp_sharding_strategy"] = "FULL_SHARD" if s.fsdp_reshard_after_forward else "SHARD_GRAD_OP"
        out["fsdp_backward_prefetch"] = s.fsdp_backward_prefetch or "BACKWARD_PRE"
        out["fsdp_forward_prefetch"] = s.fsdp_forward_prefetch
    else:
        out["fsdp_reshard_after_forward"] = s.fsdp_reshard_after_forward
    if s.fsdp_wrap_policy == "TRANSFORMER_BASED_WRAP":
        out["fsdp_transformer_layer_cls_to_wrap"] = s.fsdp_transformer_layer_cls
    else:
        out["fsdp_min_num_params"] = s.fsdp_min_num_params
    return out


def write(s: LaunchSettings, path: str) -> dict[str, Any]:
    """Check, build and write atomically (the user's umask); returns the mapping written."""
    config = build(s)
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
    return config
