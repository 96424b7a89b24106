"""Flags of the training run itself: output, saving, resume, steps, precision, logging, validation."""

from __future__ import annotations

import argparse
import os
import random
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

import toml

from library.cli.deepspeed import deepspeed_options_from_args
from library.cli.hub import HubFlags, hub_options_from_args
from library.cli.options import MAX_SEED, SEED, add_flags, at_least, flag, flag_specs, settings_from
from library.core.errors import ConfigError
from library.train.distributed.distributed import DDP_BACKENDS, ddp_backend_problem
from library.train.memory.compile import DYNAMO_MODES, CompileOptions, dynamo_backends
from library.train.observe.profiling import parse_step_range
from library.train.settings import TrainingOptions
from library.train.observe.tracking import WANDB_MISSING, wandb_installed

logger = logging.getLogger(__name__)

SAVE_PRECISIONS = (None, "float", "fp16", "bf16")
MIXED_PRECISIONS = ("no", "fp16", "bf16")


@dataclass
class OutputFlags:
    flag_group: ClassVar[str] = "output and saving"
    output_dir: Optional[str] = flag(None, "folder for the LoRA files, states, config and logs")
    output_name: Optional[str] = flag(None, "base file name of the saved LoRA (default 'last'): a name, not a path "
                                            "(the folder is --output_dir)")
    save_model_as: str = flag("safetensors", "file format of saved networks", choices=("safetensors", "ckpt", "pt"))
    save_precision: Optional[str] = flag(None, "dtype of saved tensors (default: as trained)",
                                               choices=SAVE_PRECISIONS[1:])
    save_every_n_epochs: Optional[int] = flag(None, "save <name>-<epoch>.<ext> every N epochs", range=at_least(1))
    save_n_epoch_ratio: Optional[int] = flag(None, "save about N times over the run", range=at_least(1))
    save_every_n_steps: Optional[int] = flag(None, "save <name>-step<step>.<ext> every N steps", range=at_least(1))
    save_last_n_epochs: Optional[int] = flag(None, "keep only the last N epoch files", range=at_least(1))
    save_last_n_epochs_state: Optional[int] = flag(None, "keep only the last N epoch states (default: "
                                                         "--save_last_n_epochs)", range=at_least(1))
    save_last_n_steps: Optional[int] = flag(None, "keep step files from the last N steps only", range=at_least(1))
    save_last_n_steps_state: Optional[int] = flag(None, "keep states of the last N steps only (default: "
                                                        "--save_last_n_steps)", range=at_least(1))
    save_state: bool = flag(False, "also save the training state with each model file")
    save_state_on_train_end: bool = flag(False, "save <name>-state at the end even without --save_state")
    resume: Optional[str] = flag(None, "state folder to resume from, or 'auto' for the newest state in output_dir")
    initial_step: Optional[int] = flag(None, "start counting at this optimizer step (sd-scripts; with --resume it "
                                             "replaces the state's step; docs/resume.md)", range=at_least(0))
    initial_epoch: Optional[int] = flag(None, "start at this epoch (1-based; --initial_step wins when both are given)",
                                              range=at_least(1))
    skip_until_initial_step: bool = flag(False, "with --initial_step/--initial_epoch: skip the batches of the steps "
                                                "before it and train the rest up to --max_train_steps")


@dataclass
class StepsFlags:
    flag_group: ClassVar[str] = "steps and precision"
    max_train_steps: int = flag(1600, "optimizer steps to train (sd-scripts' default 1600)", range=at_least(1))
    max_train_epochs: Optional[int] = flag(None, "overrides --max_train_steps", range=at_least(1))
    seed: Optional[int] = flag(None, "seed of everything random (a random one is drawn and recorded when not given)",
                                     range=SEED)
    gradient_accumulation_steps: int = flag(1, "batches per optimizer step", range=at_least(1))
    mixed_precision: str = flag("no", "autocast dtype; the frozen base model is stored in it too",
                                      choices=MIXED_PRECISIONS)
    full_fp16: bool = flag(False, "train the network itself in fp16")
    full_bf16: bool = flag(False, "train the network itself in bf16")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward: less memory, slower")
    xformers: bool = flag(False, "xformers attention when the package is installed (pip install xformers); otherwise "
                                 "a warning and PyTorch SDPA (sd-scripts' --diffusers_xformers is the same flag)",
                                 aliases=("diffusers_xformers",))
    sdpa: bool = flag(False, "PyTorch SDPA attention (the default)")
    flash_attn: bool = flag(False, "FlashAttention in the denoiser through diffusers' attention backends when the "
                                   "flash-attn package is installed (CUDA); otherwise a warning and PyTorch SDPA")
    torch_compile: bool = flag(False, "compile the denoiser's blocks with torch.compile (regional: the first step "
                                      "traces each block kind once; slower first step, faster steps after)")
    dynamo_backend: str = flag("inductor", "torch.compile backend (inductor, aot_eager, eager, cudagraphs, ...; "
                                           "default inductor)", parse=str.lower)
    dynamo_mode: Optional[str] = flag(None, "inductor mode (default: PyTorch's)",
                                            choices=DYNAMO_MODES)
    dynamo_fullgraph: bool = flag(False, "torch.compile fullgraph=True (no graph breaks)")
    dynamo_dynamic: bool = flag(False, "torch.compile dynamic=True (shapes as symbols)")
    mem_eff_attn: bool = flag(False, "accepted for compatibility; SDPA is used (it picks a memory-efficient kernel "
                                     "itself)")
    lowram: bool = flag(False, "with several processes on one machine, they load the model one after another (one "
                               "loading peak in RAM at a time)")
    highvram: bool = flag(False, "keep the VAE / text encoders whose outputs are cached on the GPU (faster sampling; "
                                 "by default they wait in CPU memory)")
    cpu: bool = flag(False, "train on the CPU even when an accelerator is present")
    disable_mmap_load_safetensors: bool = flag(False, "accepted for sd-scripts compatibility (a workaround for slow "
                                                      "mmap reads on some Windows/WSL disks)")


@dataclass
class MultiProcessFlags:
    flag_group: ClassVar[str] = "multi-process (accelerate launch / torchrun; docs/distributed.md)"
    ddp_timeout: Optional[int] = flag(None, "timeout of the processes' collective operations (PyTorch's default: 30 "
                                            "minutes for gloo, 10 for nccl)", range=at_least(1), metavar="MINUTES")
    ddp_gradient_as_bucket_view: bool = flag(False, "DDP: gradients are views into its communication buckets (saves "
                                                    "one gradient copy)")
    ddp_static_graph: bool = flag(False, "DDP: the graph is the same every step (faster reduction; finds unused "
                                         "weights itself)")
    context_parallel_size: int = flag(1, "split each sample's tokens over N processes (context parallelism, Ulysses, "
                                         "through the denoiser's diffusers plan: FLUX.1, FLUX.2, Qwen-Image); N "
                                         "processes train one batch, world size / N batches train side by side",
                                      range=at_least(1),
                                      aliases=("cp_size",))
    tensor_parallel_size: int = flag(1, "shard the frozen denoiser's Linear layers over N processes (tensor "
                                        "parallelism through the denoiser's diffusers plan: FLUX.1, FLUX.2, "
                                        "Qwen-Image; the LoRA follows each shard); N processes train one batch, "
                                        "world size / N batches train side by side", range=at_least(1),
                                     aliases=("tp_size",))
    ddp_backend: str = flag("auto", "the processes' communication backend: auto (nccl on CUDA GPUs, gloo on CPUs and "
                                    "on Windows), nccl, or gloo", choices=DDP_BACKENDS)


@dataclass
class LoggingFlags:
    flag_group: ClassVar[str] = "logging"
    logging_dir: Optional[str] = flag(None, "TensorBoard folder (logging is on when given)")
    log_with: Optional[str] = flag(None, "tracker (default tensorboard when --logging_dir is given)",
                                         choices=("tensorboard", "wandb", "all"))
    log_prefix: Optional[str] = flag(None, "prefix of the run's log folder name")
    log_tracker_name: Optional[str] = flag(None, "tracker name (default network_train)")
    log_tracker_config: Optional[str] = flag(None, "TOML file of tracker settings: [wandb] (entity, tags, notes, ... "
                                                   "for wandb.init) and [tensorboard] (SummaryWriter keyword "
                                                   "arguments)")
    log_config: bool = flag(False, "store the run's flags in the tracker (wandb config, TensorBoard hparams; API key "
                                   "left out)")
    wandb_run_name: Optional[str] = flag(None, "name of the wandb run (default: wandb's)")
    wandb_api_key: Optional[str] = flag(None, "wandb API key (else WANDB_API_KEY or `wandb login`); never written to "
                                              "the saved config")
    console_log_level: Optional[str] = flag(None, "level of the messages printed (default INFO, or $LOGLEVEL)",
                                            choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    console_log_file: Optional[str] = flag(None, "also write the messages to this file (appended)")
    console_log_simple: bool = flag(False, "plain messages: no level and logger name")
    log_every_n_steps: int = flag(1, "write scalars every N steps", range=at_least(1))
    log_tflops: Optional[int] = flag(None, "every N steps, log the achieved model TFLOP/s (FLOPs counted once on the "
                                           "first step) and, on a known GPU, the fraction of its bf16 peak",
                                           range=at_least(1), metavar="N")


@dataclass
class DiagnosticsFlags:
    flag_group: ClassVar[str] = "diagnostics"
    profile_steps: bool = flag(False, "per-step timing breakdown in the log and TensorBoard: data wait, forward, "
                                      "backward (and the all-reduce overlapped with it), optimizer, other")
    profile_microbatches: bool = flag(False, "with the breakdown, the forward/backward time of every "
                                             "gradient-accumulation micro-batch")
    profiler_trace_dir: Optional[str] = flag(None, "write a torch.profiler trace of --profiler_trace_steps here "
                                                   "(TensorBoard / Perfetto)")
    debug_dataset: bool = flag(False, "print the first epoch's batches as training loads them (captions, buckets, "
                                      "crops, weights) and exit: no model loads, nothing trains")
    debug_dataset_dir: Optional[str] = flag(None, "with --debug_dataset: also write each batch's images here as PNG "
                                                  "(sd-scripts shows them in a window)")
    profiler_trace_steps: str = flag("3-4", "optimizer steps the trace covers, inclusive (default 3-4: after warm-up)",
                                            metavar="A-B")


@dataclass
class ValidationFlags:
    flag_group: ClassVar[str] = "validation"
    validate_every_n_steps: Optional[int] = flag(None, "validation loss every N steps (needs validation_split)",
                                                       range=at_least(1))
    validate_every_n_epochs: Optional[int] = flag(None, "validation loss every N epochs", range=at_least(1))
    max_validation_steps: Optional[int] = flag(None, "at most N validation batches each time", range=at_least(1))


TRAINING_FLAG_GROUPS = (OutputFlags, StepsFlags, MultiProcessFlags, LoggingFlags, DiagnosticsFlags, ValidationFlags,
                        HubFlags)


TRACKERS = ("tensorboard", "wandb")
_SECRET_FLAGS = ("wandb_api_key", "huggingface_token")
# sd-scripts flags that change nothing here, and why; each given one is said once at the start of a run.
COMPATIBILITY_FLAGS = {
    "sdpa": "PyTorch SDPA is the default attention here",
    "mem_eff_attn": "PyTorch SDPA is used, which picks a memory-efficient kernel itself",
    "cache_info": "image sizes are read from file headers here; there is no meta-information cache to write",
    "disable_mmap_load_safetensors": "a workaround for slow mmap reads on some Windows/WSL disks in sd-scripts' "
                                     "loaders; the loaders here read through safetensors / diffusers",
    "use_safetensors": "safetensors is already the default --save_model_as here",
    "t5xxl_device": "marked [DOES NOT WORK] in sd-scripts too; T5-XXL runs with the other text encoders",
    "t5xxl_dtype": "marked [DOES NOT WORK] in sd-scripts too; T5-XXL takes the run's dtype",
    "no_token_padding": "sd-scripts (48d368fa) sets it and reads it nowhere: the code that used it is commented out",
    "save_clip": "marked [DOES NOT WORK] in sd-scripts too (no unified SD3 checkpoint with CLIP)",
    "save_t5xxl": "marked [DOES NOT WORK] in sd-scripts too (no unified SD3 checkpoint with T5-XXL)",
}


def note_compatibility_flags(values: Mapping[str, Any]) -> None:
    """One info line per given flag of COMPATIBILITY_FLAGS (values: vars(namespace))."""
    for flag, value in values.items():  # .items(): these flags are listed, not used (tests/test_flag_audit.py)
        if flag in COMPATIBILITY_FLAGS and value:
            logger.info("--%s: accepted for sd-scripts compatibility; %s", flag, COMPATIBILITY_FLAGS[flag])


def read_tracker_config(path: Optional[str], log_with: Optional[str]) -> dict:
    """--log_tracker_config: {"wandb": {...}, "tensorboard": {...}} from a TOML file, checked now."""
    if not path:
        return {}
    if not log_with:
        raise ConfigError("--log_tracker_config: no tracker is on; add --log_with (or --logging_dir)")
    if not os.path.isfile(path):
        raise ConfigError(f"--log_tracker_config {path}: file not found")
    try:
        data = toml.load(path)
    except (toml.TomlDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--log_tracker_config {path}: not valid TOML: {str(e).splitlines()[0]}") from None
    for key, value in data.items():
        if key not in TRACKERS or not isinstance(value, dict):
            raise ConfigError(f"--log_tracker_config {path}: [{key}]: expected tables named "
                              f"{' or '.join(f'[{t}]' for t in TRACKERS)}")
    return data


def check_file_name(flag_name: str, name: Optional[str], example: str, folder_flag: str) -> None:
    """A flag whose value is joined to a folder as one name (--output_name to --output_dir, --log_prefix and
    --log_tracker_name to --logging_dir): no folder part, no `..`, not empty, so nothing is written outside."""
    if name is None:
        return
    problem = ("is empty" if not name.strip() else "contains a NUL character" if "\0" in name
               else "is a path" if "/" in name or "\\" in name or name in (".", "..") else None)
    if problem:
        raise ConfigError(f"{flag_name} {name!r}: {problem}; expected a file name such as {example} "
                          f"(no '/', '\\' or '..'; the folder is {folder_flag})")


def check_output_name(name: Optional[str]) -> None:
    """--output_name is a file name inside --output_dir (sd-scripts' use); the saved files, states and
    `<name>_config.toml` are joined to --output_dir with it."""
    check_file_name("--output_name", name, "my_lora", "--output_dir")


def training_options_from_args(ns: argparse.Namespace,
                               gradient_checkpointing: Optional[bool] = None) -> TrainingOptions:
    """TrainingOptions; the checks are those of flag combinations (each flag's own range is declared).
    `gradient_checkpointing`: the value other flags imply (library/cli/memory.py), else the flag."""
    if not ns.output_dir:
        raise ConfigError("--output_dir: required (the folder for the LoRA, states and logs)")
    check_output_name(ns.output_name)
    check_file_name("--log_prefix", ns.log_prefix, "run1_", "--logging_dir")
    check_file_name("--log_tracker_name", ns.log_tracker_name, "network_train", "--logging_dir")
    if ns.full_fp16 and ns.full_bf16:
        raise ConfigError("--full_fp16 and --full_bf16: choose one")
    if ns.full_fp16 and ns.mixed_precision != "fp16":
        raise ConfigError("--full_fp16 needs --mixed_precision fp16")
    if ns.full_bf16 and ns.mixed_precision != "bf16":
        raise ConfigError("--full_bf16 needs --mixed_precision bf16")
    check_ddp_backend(ns.ddp_backend, ns.cpu)
    if not ns.debug_dataset and ns.debug_dataset_dir:  # --debug_dataset itself: library/cli/entry.py
        raise ConfigError("--debug_dataset_dir: only used with --debug_dataset")
    if ns.skip_until_initial_step and ns.initial_step is None and ns.initial_epoch is None:
        raise ConfigError("--skip_until_initial_step: needs --initial_step or --initial_epoch")
    log_with = ns.log_with
    if log_with is None and ns.logging_dir:
        log_with = "tensorboard"  # sd-scripts logs to TensorBoard when a logging_dir is given
    if log_with in ("tensorboard", "all") and not ns.logging_dir:
        raise ConfigError(f"--log_with {log_with}: needs --logging_dir (the TensorBoard folder)")
    if log_with in ("wandb", "all") and not wandb_installed():
        raise ConfigError(WANDB_MISSING)
    if log_with not in ("wandb", "all"):
        for name, value in (("wandb_run_name", ns.wandb_run_name), ("wandb_api_key", ns.wandb_api_key)):
            if value:
                raise ConfigError(f"--{name}: only used with --log_with wandb or all")
    tracker_config = read_tracker_config(ns.log_tracker_config, log_with)
    if ns.log_config and not log_with:
        raise ConfigError("--log_config: no tracker is on; add --log_with (or --logging_dir)")
    run_config = ({k: v for k, v in sorted(vars(ns).items()) if k not in _SECRET_FLAGS and v is not None}
                  if ns.log_config else {})
    return settings_from(
        TrainingOptions, ns,
        output_name=ns.output_name or "last",
        seed=random.randint(0, MAX_SEED) if ns.seed is None else ns.seed,
        gradient_checkpointing=ns.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing,
        log_with=log_with,
        log_tracker_config=tracker_config,
        log_config=run_config,
        compile=_compile_options(ns),
        profile_steps=ns.profile_steps or ns.profile_microbatches,
        profiler_trace_steps=_trace_steps(ns),
        deepspeed=deepspeed_options_from_args(ns),
        hub=hub_options_from_args(ns),
    )


def check_ddp_backend(backend: str, cpu: bool) -> None:
    """--ddp_backend nccl on a machine without CUDA (or on Windows, or with --cpu) is refused before any work."""
    if backend == "nccl":
        import torch

        problem = ddp_backend_problem(backend, cpu, torch.cuda.is_available())
        if problem:
            raise ConfigError(problem)


def _trace_steps(ns: argparse.Namespace) -> tuple[int, int]:
    try:
        return parse_step_range(ns.profiler_trace_steps)
    except ValueError as e:
        raise ConfigError(f"--profiler_trace_steps: {e}") from None


def _compile_options(ns: argparse.Namespace) -> CompileOptions:
    opts = settings_from(CompileOptions, ns)
    if not opts.torch_compile:
        return opts
    backends = dynamo_backends()
    if opts.dynamo_backend not in backends:
        raise ConfigError(f"--dynamo_backend: expected one of {', '.join(backends)}, got {ns.dynamo_backend!r}")
    if opts.dynamo_mode and opts.dynamo_backend != "inductor":
        raise ConfigError(f"--dynamo_mode {opts.dynamo_mode}: an inductor option, but --dynamo_backend is "
                          f"{opts.dynamo_backend}")
    return opts
