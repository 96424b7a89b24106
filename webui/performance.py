"""The Performance (and Diagnostics) options of a job and whether this machine, the job's family and the trainer can use each.

Packages are looked up with importlib.util.find_spec (nothing is imported), GPUs with nvidia-smi
(webui.hardware), and the trainer's flags from its own `--describe_flags` JSON (run once per script, kept for the
server's life): the UI imports no trainer.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from webui.jobfiles import REPO_ROOT, find_key

# Families whose transformer blocks can be swapped to CPU memory (the DiT families; the trainer's
# family_supports_block_swap says the same for every family the UI has templates of: a test compares them).
BLOCK_SWAP_FAMILIES = ("flux", "sd3", "anima", "chroma", "lumina", "hunyuan_image", "zimage")

# key, label, help, section of config.toml, kind ("bool" | "int" | "memory"), [requirements]
# requirements: "gpu", "package:<module>[:<pip name>]", "family:block_swap", "flag" (the trainer has --key),
# "needs:<key>" (another option must be on; checked against the settings).
OPTIONS = [
    ("persistent_data_loader_workers", "Persistent data-loader workers",
     "keep the data-loader worker processes alive between epochs (no restart cost per epoch)", "dataset", "bool",
     ["flag", "needs:max_data_loader_n_workers"]),
    ("gradient_checkpointing", "Gradient checkpointing",
     "recompute activations in the backward pass: much less memory, about 20% slower", "training", "bool", ["flag"]),
    ("flash_attn", "Flash attention", "requires flash-attn: FlashAttention-2 kernels for attention (CUDA GPUs)",
     "training", "bool", ["gpu", "package:flash_attn:flash-attn", "flag"]),
    ("torch_compile", "Torch compile", "dynamo inductor; slower first step (the model is compiled), faster after",
     "training", "bool", ["package:torch", "flag"]),
    ("dynamo_backend", "Compile backend", "torch.compile backend (blank: inductor; aot_eager and eager compile "
     "less and start faster)", "training", "choice:inductor|aot_eager|eager|cudagraphs", ["flag", "needs:torch_compile"]),
    ("dynamo_mode", "Compile mode", "inductor mode (blank: PyTorch's default; max-autotune tunes kernels: a much "
     "slower first step)", "training", "choice:default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs",
     ["flag", "needs:torch_compile"]),
    ("memory", "Load model to", ("VRAM (--highvram: keep the cached parts on the GPU) or RAM (--lowram: the "
     "processes of a machine load the model one after another, one loading peak in RAM at a time)"),
     "training", "memory", ["gpu"]),
    ("blocks_to_swap", "Block swap count", ("0 = off; N transformer blocks stay in CPU memory and are streamed "
     "to the GPU (DiT families only: flux, sd3, anima, chroma, lumina, hunyuan_image, zimage)"), "memory", "int",
     ["family:block_swap", "gpu", "flag"]),
    ("cpu_offload_checkpointing", "Activation CPU offload", ("--cpu_offload_checkpointing: keep checkpointed "
     "activations in CPU memory until backward; requires gradient checkpointing (every family)"), "memory", "bool",
     ["gpu", "flag", "needs:gradient_checkpointing"]),
    # Diagnostics: trainer flags, offered once the job's script has them
    ("profile_steps", "Per-step timing breakdown", "--profile_steps: how long data loading, forward, backward and "
     "the optimizer step take in each step, in the log", "diagnostics", "bool", ["flag"]),
    ("profile_microbatches", "Per-micro-batch times", "--profile_microbatches: the time of every micro-batch "
     "(with gradient accumulation), in the log", "diagnostics", "bool", ["flag"]),
]
DIAGNOSTICS = ("profile_steps", "profile_microbatches")
NEEDS_TEXT = {"max_data_loader_n_workers": "needs data-loader workers > 0",
              "gradient_checkpointing": "requires gradient checkpointing (turn it on first)",
              "torch_compile": "only with torch compile on"}
MEMORY_FLAGS = ("highvram", "lowram")


_DESCRIPTIONS: dict[str, dict[str, Any]] = {}
_DESCRIPTION_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def trainer_description(script: str, timeout: float = 120) -> dict[str, Any] | None:
    """`<script> --describe_flags`: every flag of the script (name, type, default, choices, help, group, range) and
    its family's facts, learned once per script; None (and asked again next time) when the script cannot say."""
    with _LOCKS_LOCK:
        lock = _DESCRIPTION_LOCKS.setdefault(script, threading.Lock())
    with lock:  # one run per script, also when the start-up thread and a request ask at once
        if script not in _DESCRIPTIONS:
            try:
                result = subprocess.run([sys.executable, script, "--describe_flags"], check=False, cwd=REPO_ROOT,
                                        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                return None
            if result.returncode != 0:
                return None
            try:
                description = json.loads(result.stdout)
            except ValueError:
                return None
            if not isinstance(description, dict) or not isinstance(description.get("flags"), list):
                return None
            _DESCRIPTIONS[script] = description
        return _DESCRIPTIONS[script]


def trainer_flags(script: str, timeout: float = 120) -> frozenset[str]:
    """The flags (and their other names, without the dashes) that `script` describes; empty when it cannot say."""
    description = trainer_description(script, timeout)
    if description is None:
        return frozenset()
    return frozenset(name for flag in description["flags"] for name in (flag["name"], *flag.get("aliases", ())))


def package_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def config_value(config: dict, key: str) -> Any:
    section = find_key(config, key)
    if section is None:
        return None
    return config[key] if section == "" else config[section][key]


def _needs_on(config: dict, key: str) -> bool:
    value = config_value(config, key)
    if key == "max_data_loader_n_workers":
        return value is None or (isinstance(value, int) and value > 0)  # the trainer's default is 8
    return bool(value)


def availability(family: str, script: str, gpu_count: int,
                 installed: Callable[[str], bool] = package_installed,
                 flags: frozenset[str] | None = None) -> list[dict[str, Any]]:
    """Each option with `available` and, when not, `reason` (every reason, '; '-joined). `needs`: the option
    that must be on as well (the page disables it while that one is off; the server refuses it)."""
    flags = trainer_flags(script) if flags is None else flags
    out = []
    for key, label, help_text, section, kind, requirements in OPTIONS:
        reasons, needs = [], None
        for req in requirements:
            if req == "gpu" and gpu_count == 0:
                reasons.append("no GPU on this machine")
            elif req.startswith("package:"):
                module, _, pip_name = req[len("package:"):].partition(":")
                if not installed(module):
                    reasons.append(f"requires {pip_name or module} (pip install {pip_name or module}): not installed")
            elif req == "family:block_swap" and family not in BLOCK_SWAP_FAMILIES:
                reasons.append(f"not supported for {family} (DiT families only: {', '.join(BLOCK_SWAP_FAMILIES)})")
            elif req == "flag":
                missing = [f for f in (MEMORY_FLAGS if kind == "memory" else (key,)) if f not in flags]
                if missing:
                    reasons.append(f"the trainer ({script}) has no --{missing[0]} flag yet")
            elif req.startswith("needs:"):
                needs = req[len("needs:"):]
        out.append({"key": key, "label": label, "help": help_text, "section": section, "kind": kind,
                    "group": "diagnostics" if key in DIAGNOSTICS else "performance",
                    "available": not reasons, "reason": "; ".join(reasons) or None,
                    "needs": needs, "needs_reason": NEEDS_TEXT.get(needs) if needs else None})
    return out


def is_on(config: dict, option: dict[str, Any]) -> bool:
    if option["kind"] == "memory":
        return any(bool(config_value(config, f)) for f in MEMORY_FLAGS)
    value = config_value(config, option["key"])
    if option["kind"] == "int":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if option["kind"].startswith("choice:"):
        return value is not None and value != ""
    return bool(value)


def refusal(config: dict, options: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(one-line error, field) for the first option the settings turn on that cannot be used, else None."""
    for option in options:
        if not is_on(config, option):
            continue
        field = option["key"]
        if not option["available"]:
            flag = "--highvram/--lowram" if option["kind"] == "memory" else f"--{field}"
            return f"{flag}: not available: {option['reason']}", field
        if option["needs"] and not _needs_on(config, option["needs"]):
            return f"--{field}: {option['needs_reason']}", field
    if config_value(config, "highvram") and config_value(config, "lowram"):
        return "--highvram and --lowram: choose one (VRAM or RAM)", "memory"
    return None
