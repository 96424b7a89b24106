"""A job's GPU selection and multi-GPU strategy (`<job>/launch.toml`), and its accelerate config, written by
the project's generator as a subprocess: `python tools/make_accelerate_config.py --strategy ... --output PATH`."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from webui.jobfiles import REPO_ROOT, SettingsError, one_line_error

GENERATOR = os.path.join("tools", "make_accelerate_config.py")
STRATEGIES = ("single", "ddp", "fsdp1", "fsdp2", "deepspeed")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# launch.toml key -> (strategies it applies to, generator flag, kind). kind: "flag" (on/off switch),
# "bool" (true|false value), "choice:<values>", "int".
STRATEGY_OPTIONS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "fsdp_cpu_offload": (("fsdp1", "fsdp2"), "--fsdp_cpu_offload", "flag"),
    "fsdp_reshard_after_forward": (("fsdp1", "fsdp2"), "--fsdp_reshard_after_forward", "bool"),
    "fsdp_activation_checkpointing": (("fsdp1", "fsdp2"), "--fsdp_activation_checkpointing", "flag"),
    "fsdp_cpu_ram_efficient_loading": (("fsdp1", "fsdp2"), "--fsdp_cpu_ram_efficient_loading", "flag"),
    "fsdp_backward_prefetch": (("fsdp1", "fsdp2"), "--fsdp_backward_prefetch", "choice:" + "|".join(PREFETCH)),
    "fsdp_forward_prefetch": (("fsdp1",), "--fsdp_forward_prefetch", "flag"),
    "fsdp_use_orig_params": (("fsdp1", "fsdp2"), "--fsdp_use_orig_params", "bool"),
    "fsdp_limit_all_gathers": (("fsdp1", "fsdp2"), "--fsdp_limit_all_gathers", "bool"),
    "fsdp_wrap_policy": (("fsdp1", "fsdp2"), "--fsdp_wrap_policy", "choice:" + "|".join(WRAP_POLICIES)),
    "fsdp_min_num_params": (("fsdp1", "fsdp2"), "--fsdp_min_num_params", "int"),
    "zero_stage": (("deepspeed",), "--zero_stage", "choice:1|2|3"),
    "offload_optimizer_device": (("deepspeed",), "--offload_optimizer_device", "choice:" + "|".join(OFFLOAD_DEVICES)),
    "offload_param_device": (("deepspeed",), "--offload_param_device", "choice:" + "|".join(OFFLOAD_DEVICES)),
}
LAUNCH_KEYS = ("gpu_ids", "strategy", *STRATEGY_OPTIONS)


def clean_launch(launch: Any, gpu_indices: list[int], mode: str) -> dict[str, Any]:
    """The launch settings checked (SettingsError naming the field), blank values dropped."""
    if launch is None:
        launch = {}
    if not isinstance(launch, dict):
        raise SettingsError("launch: expected {gpu_ids: [...], strategy: ..., ...}", None)
    out: dict[str, Any] = {}
    for key, value in launch.items():
        if key not in LAUNCH_KEYS:
            raise SettingsError(f"launch.{key}: unknown setting; one of {', '.join(LAUNCH_KEYS)}", key)
        if value is None or value == "" or value == []:
            continue
        out[key] = value
    ids = out.get("gpu_ids", [])
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids) \
            or len(set(ids)) != len(ids):
        raise SettingsError(f"gpu_ids: expected a list of distinct GPU indices, got {ids!r}", "gpu_ids")
    unknown = [i for i in ids if i not in gpu_indices]
    if unknown:
        found = ", ".join(map(str, gpu_indices)) or "none: training runs on CPU"
        raise SettingsError(f"gpu_ids: no GPU {unknown[0]} on this machine (GPUs found: {found})", "gpu_ids")
    if ids:
        out["gpu_ids"] = sorted(ids)
    strategy = out.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        raise SettingsError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}", "strategy")
    if len(ids) > 1 and strategy in (None, "single"):
        raise SettingsError(f"strategy: {len(ids)} GPUs selected: choose a multi-GPU strategy "
                            "(DDP, FSDP1, FSDP2 or DeepSpeed)", "strategy")
    if not gpu_indices and strategy not in (None, "single"):
        # accelerate launch starts one process on a machine without GPUs (its multi-CPU mode needs mpirun)
        raise SettingsError(f"strategy: {strategy} needs GPUs (none on this machine): on the CPU, accelerate "
                            "launch runs one process; choose single", "strategy")
    if gpu_indices and strategy not in (None, "single") and len(ids) < 2:
        raise SettingsError(f"gpu_ids: {strategy} runs one process per chosen GPU: choose 2 or more", "gpu_ids")
    for key, (strategies, _, kind) in STRATEGY_OPTIONS.items():
        if key not in out:
            continue
        value = out[key]
        if strategy not in strategies:
            del out[key]  # an option of another strategy: not this job's
            continue
        if kind in ("flag", "bool") and not isinstance(value, bool):
            raise SettingsError(f"{key}: expected true or false, got {value!r}", key)
        if kind.startswith("choice:") and str(value) not in kind[7:].split("|"):
            raise SettingsError(f"{key}: expected one of {kind[7:].replace('|', ', ')}, got {value!r}", key)
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SettingsError(f"{key}: expected an integer >= 1, got {value!r}", key)
    if mode == "lora" and out.get("fsdp_use_orig_params") is False:
        raise SettingsError("fsdp_use_orig_params: must stay on with LoRA (frozen base weights and trained LoRA "
                            "weights share FSDP units)", "fsdp_use_orig_params")
    return out


def num_processes(launch: dict[str, Any]) -> int:
    """One process per chosen GPU (one when none is chosen)."""
    return len(launch.get("gpu_ids") or []) or 1


def generator_command(launch: dict[str, Any], family: str, mode: str, config: dict[str, Any], output: str,
                      cpu: bool = False) -> list[str]:
    """The generator's command line for the job's launch settings (only the chosen strategy's options); the
    precision and gradient accumulation come from the job's config (`config`: flag name -> value); `cpu`:
    a machine without GPUs."""
    strategy = launch["strategy"]
    argv = [sys.executable, GENERATOR, "--strategy", strategy, "--num_processes", str(num_processes(launch))]
    if launch.get("gpu_ids"):
        argv += ["--gpu_ids", ",".join(map(str, launch["gpu_ids"]))]
    if cpu:
        argv.append("--cpu")
    if config.get("mixed_precision") in ("no", "fp16", "bf16"):
        argv += ["--mixed_precision", config["mixed_precision"]]
    if strategy == "deepspeed" and config.get("gradient_accumulation_steps"):
        argv += ["--gradient_accumulation_steps", str(config["gradient_accumulation_steps"])]
    # a ControlNet-LLLite job is a network over a frozen model: the generator's "lora"
    argv += ["--family", family, "--mode", "lora" if mode == "controlnet_lllite" else mode]
    for key, (strategies, flag, kind) in STRATEGY_OPTIONS.items():
        if strategy not in strategies or key not in launch:
            continue
        value = launch[key]
        if kind == "flag":
            if value:
                argv.append(flag)
        elif kind == "bool":
            argv += [flag, "true" if value else "false"]
        else:
            argv += [flag, str(value)]
    return argv + ["--output", output]


def write_accelerate_config(launch: dict[str, Any], family: str, mode: str, config: dict[str, Any], output: str,
                            cpu: bool = False, timeout: float = 120) -> None:
    """Run the generator; its one-line error (exit 2) becomes a SettingsError naming the option."""
    if not os.path.isfile(os.path.join(REPO_ROOT, GENERATOR)):
        raise SettingsError(f"strategy: {GENERATOR} is not in this toolkit yet: cannot write the accelerate config",
                            "strategy")
    argv = generator_command(launch, family, mode, config, output, cpu)
    result = subprocess.run(argv, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0 or not os.path.isfile(output):
        message = one_line_error(result.stderr or result.stdout).replace(output, "accelerate_config.yaml")
        field = next((key for key in ("gpu_ids", *STRATEGY_OPTIONS) if f"--{key}" in message), "strategy")
        raise SettingsError(f"{GENERATOR}: {message}", field)
