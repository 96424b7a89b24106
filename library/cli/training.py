"""Flags of the training run itself: output, saving, resume, steps, precision, logging, validation."""

from __future__ import annotations

import argparse
import os
import random
import logging
from typing import Any, Mapping, Optional

import toml

from library.cli.deepspeed import deepspeed_options_from_args
from library.core.errors import ConfigError
from library.train.compile import DYNAMO_MODES, CompileOptions, dynamo_backends
from library.train.profiling import parse_step_range
from library.train.settings import TrainingOptions
from library.train.tracking import WANDB_MISSING, wandb_installed

logger = logging.getLogger(__name__)

SAVE_PRECISIONS = (None, "float", "fp16", "bf16")
MIXED_PRECISIONS = ("no", "fp16", "bf16")


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output and saving")
    g.add_argument("--output_dir", type=str, default=None, help="folder for the LoRA files, states, config and logs")
    g.add_argument("--output_name", type=str, default=None,
                   help="base file name of the saved LoRA (default 'last'): a name, not a path "
                        "(the folder is --output_dir)")
    g.add_argument("--save_model_as", type=str, default="safetensors", choices=["safetensors", "ckpt", "pt"], help="file format of saved networks")
    g.add_argument("--save_precision", type=str, default=None, choices=[p for p in SAVE_PRECISIONS if p], help="dtype of saved tensors (default: as trained)")
    g.add_argument("--save_every_n_epochs", type=int, default=None, help="save <name>-<epoch>.<ext> every N epochs")
    g.add_argument("--save_n_epoch_ratio", type=int, default=None, help="save about N times over the run")
    g.add_argument("--save_every_n_steps", type=int, default=None, help="save <name>-step<step>.<ext> every N steps")
    g.add_argument("--save_last_n_epochs", type=int, default=None, help="keep only the last N epoch files")
    g.add_argument("--save_last_n_epochs_state", type=int, default=None, help="keep only the last N epoch states (default: --save_last_n_epochs)")
    g.add_argument("--save_last_n_steps", type=int, default=None, help="keep step files from the last N steps only")
    g.add_argument("--save_last_n_steps_state", type=int, default=None, help="keep states of the last N steps only (default: --save_last_n_steps)")
    g.add_argument("--save_state", action="store_true", help="also save the training state with each model file")
    g.add_argument("--save_state_on_train_end", action="store_true", help="save <name>-state at the end even without --save_state")
    g.add_argument("--resume", type=str, default=None,
                   help="state folder to resume from, or 'auto' for the newest state in output_dir")

    g = parser.add_argument_group("steps and precision")
    g.add_argument("--max_train_steps", type=int, default=1600, help="optimizer steps to train (sd-scripts' default 1600)")
    g.add_argument("--max_train_epochs", type=int, default=None, help="overrides --max_train_steps")
    g.add_argument("--seed", type=int, default=None, help="seed of everything random (a random one is drawn and recorded when not given)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="batches per optimizer step")
    g.add_argument("--mixed_precision", type=str, default="no", choices=list(MIXED_PRECISIONS), help="autocast dtype; the frozen base model is stored in it too")
    g.add_argument("--full_fp16", action="store_true", help="train the network itself in fp16")
    g.add_argument("--full_bf16", action="store_true", help="train the network itself in bf16")
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward: less memory, slower")
    g.add_argument("--xformers", action="store_true", help="xformers attention when the package is installed (pip install xformers); otherwise a warning and PyTorch SDPA")
    g.add_argument("--sdpa", action="store_true", help="PyTorch SDPA attention (the default)")
    g.add_argument("--flash_attn", action="store_true",
                   help="FlashAttention in the denoiser through diffusers' attention backends when the flash-attn "
                        "package is installed (CUDA); otherwise a warning and PyTorch SDPA")
    g.add_argument("--torch_compile", action="store_true",
                   help="compile the denoiser's blocks with torch.compile (regional: the first step traces each "
                        "block kind once; slower first step, faster steps after)")
    g.add_argument("--dynamo_backend", type=str.lower, default="inductor",
                   help="torch.compile backend (inductor, aot_eager, eager, cudagraphs, ...; default inductor)")
    g.add_argument("--dynamo_mode", type=str, default=None, choices=DYNAMO_MODES,
                   help="inductor mode (default: PyTorch's)")
    g.add_argument("--dynamo_fullgraph", action="store_true", help="torch.compile fullgraph=True (no graph breaks)")
    g.add_argument("--dynamo_dynamic", action="store_true", help="torch.compile dynamic=True (shapes as symbols)")
    g.add_argument("--mem_eff_attn", action="store_true",
                   help="accepted for compatibility; SDPA is used (it picks a memory-efficient kernel itself)")
    g.add_argument("--lowram", action="store_true",
                   help="with several processes on one machine, they load the model one after another (one loading "
                        "peak in RAM at a time)")
    g.add_argument("--highvram", action="store_true",
                   help="keep the VAE / text encoders whose outputs are cached on the GPU (faster sampling; by "
                        "default they wait in CPU memory)")
    g.add_argument("--cpu", action="store_true", help="train on the CPU even when an accelerator is present")

    g = parser.add_argument_group("multi-process (accelerate launch / torchrun; docs/distributed.md)")
    g.add_argument("--ddp_timeout", type=int, default=None, metavar="MINUTES",
                   help="timeout of the processes' collective operations (PyTorch's default: 30 minutes for gloo, "
                        "10 for nccl)")
    g.add_argument("--ddp_gradient_as_bucket_view", action="store_true",
                   help="DDP: gradients are views into its communication buckets (saves one gradient copy)")
    g.add_argument("--ddp_static_graph", action="store_true",
                   help="DDP: the graph is the same every step (faster reduction; finds unused weights itself)")

    g = parser.add_argument_group("logging")
    g.add_argument("--logging_dir", type=str, default=None, help="TensorBoard folder (logging is on when given)")
    g.add_argument("--log_with", type=str, default=None, choices=["tensorboard", "wandb", "all"], help="tracker (default tensorboard when --logging_dir is given)")
    g.add_argument("--log_prefix", type=str, default=None, help="prefix of the run's log folder name")
    g.add_argument("--log_tracker_name", type=str, default=None, help="tracker name (default network_train)")
    g.add_argument("--log_tracker_config", type=str, default=None,
                   help="TOML file of tracker settings: [wandb] (entity, tags, notes, ... for wandb.init) and "
                        "[tensorboard] (SummaryWriter keyword arguments)")
    g.add_argument("--log_config", action="store_true",
                   help="store the run's flags in the tracker (wandb config, TensorBoard hparams; API key left out)")
    g.add_argument("--wandb_run_name", type=str, default=None, help="name of the wandb run (default: wandb's)")
    g.add_argument("--wandb_api_key", type=str, default=None,
                   help="wandb API key (else WANDB_API_KEY or `wandb login`); never written to the saved config")
    g.add_argument("--log_every_n_steps", type=int, default=1, help="write scalars every N steps")
    g.add_argument("--log_tflops", type=int, default=None, metavar="N",
                   help="every N steps, log the achieved model TFLOP/s (FLOPs counted once on the first step) "
                        "and, on a known GPU, the fraction of its bf16 peak")

    g = parser.add_argument_group("diagnostics")
    g.add_argument("--profile_steps", action="store_true",
                   help="per-step timing breakdown in the log and TensorBoard: data wait, forward, backward "
                        "(and the all-reduce overlapped with it), optimizer, other")
    g.add_argument("--profile_microbatches", action="store_true",
                   help="with the breakdown, the forward/backward time of every gradient-accumulation micro-batch")
    g.add_argument("--profiler_trace_dir", type=str, default=None,
                   help="write a torch.profiler trace of --profiler_trace_steps here (TensorBoard / Perfetto)")
    g.add_argument("--profiler_trace_steps", type=str, default="3-4", metavar="A-B",
                   help="optimizer steps the trace covers, inclusive (default 3-4: after warm-up)")

    g = parser.add_argument_group("validation")
    g.add_argument("--validate_every_n_steps", type=int, default=None, help="validation loss every N steps (needs validation_split)")
    g.add_argument("--validate_every_n_epochs", type=int, default=None, help="validation loss every N epochs")
    g.add_argument("--max_validation_steps", type=int, default=None, help="at most N validation batches each time")




TRACKERS = ("tensorboard", "wandb")
_SECRET_FLAGS = ("wandb_api_key",)
# sd-scripts flags that change nothing here, and why; each given one is said once at the start of a run.
COMPATIBILITY_FLAGS = {
    "sdpa": "PyTorch SDPA is the default attention here",
    "mem_eff_attn": "PyTorch SDPA is used, which picks a memory-efficient kernel itself",
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


def _positive(ns: argparse.Namespace, name: str, allow_zero: bool = False) -> None:
    value = getattr(ns, name, None)
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"--{name}: expected an integer >= {0 if allow_zero else 1}, got {value}")


def check_output_name(name: Optional[str]) -> None:
    """--output_name is a file name inside --output_dir (sd-scripts' use): no folder part, no `..`, not empty.
    The saved files, states and `<name>_config.toml` are joined to --output_dir with it, so a path here would
    write outside that folder."""
    if name is None:
        return
    problem = ("is empty" if not name.strip() else "contains a NUL character" if "\0" in name
               else "is a path" if "/" in name or "\\" in name or name in (".", "..") else None)
    if problem:
        raise ConfigError(f"--output_name {name!r}: {problem}; expected a file name such as my_lora "
                          "(no '/', '\\' or '..'; the folder is --output_dir)")


def training_options_from_args(ns: argparse.Namespace, gradient_checkpointing: Optional[bool] = None) -> TrainingOptions:
    """Translate the namespace into TrainingOptions, checking flag combinations. `gradient_checkpointing`:
    the value other flags imply (library/cli/memory.py), else the flag."""
    if not ns.output_dir:
        raise ConfigError("--output_dir: required (the folder for the LoRA, states and logs)")
    check_output_name(ns.output_name)
    for name in ("max_train_steps", "max_train_epochs", "gradient_accumulation_steps", "save_every_n_epochs",
                 "save_every_n_steps", "save_last_n_epochs", "save_last_n_epochs_state", "save_last_n_steps",
                 "save_last_n_steps_state", "validate_every_n_steps", "validate_every_n_epochs",
                 "max_validation_steps", "save_n_epoch_ratio", "log_every_n_steps", "log_tflops", "ddp_timeout"):
        _positive(ns, name)
    if ns.full_fp16 and ns.full_bf16:
        raise ConfigError("--full_fp16 and --full_bf16: choose one")
    if ns.full_fp16 and ns.mixed_precision != "fp16":
        raise ConfigError("--full_fp16 needs --mixed_precision fp16")
    if ns.full_bf16 and ns.mixed_precision != "bf16":
        raise ConfigError("--full_bf16 needs --mixed_precision bf16")
    log_with = ns.log_with
    if log_with is None and ns.logging_dir:
        log_with = "tensorboard"  # sd-scripts logs to TensorBoard when a logging_dir is given
    if log_with in ("tensorboard", "all") and not ns.logging_dir:
        raise ConfigError(f"--log_with {log_with}: needs --logging_dir (the TensorBoard folder)")
    if log_with in ("wandb", "all") and not wandb_installed():
        raise ConfigError(WANDB_MISSING)
    if log_with not in ("wandb", "all"):
        for flag in ("wandb_run_name", "wandb_api_key"):
            if getattr(ns, flag, None):
                raise ConfigError(f"--{flag}: only used with --log_with wandb or all")
    tracker_config = read_tracker_config(ns.log_tracker_config, log_with)
    if ns.log_config and not log_with:
        raise ConfigError("--log_config: no tracker is on; add --log_with (or --logging_dir)")
    run_config = ({k: v for k, v in sorted(vars(ns).items()) if k not in _SECRET_FLAGS and v is not None}
                  if ns.log_config else {})
    return TrainingOptions(
        output_dir=ns.output_dir,
        output_name=ns.output_name or "last",
        save_model_as=ns.save_model_as,
        save_precision=ns.save_precision,
        save_every_n_epochs=ns.save_every_n_epochs,
        save_every_n_steps=ns.save_every_n_steps,
        save_last_n_epochs=ns.save_last_n_epochs,
        save_last_n_epochs_state=ns.save_last_n_epochs_state,
        save_last_n_steps=ns.save_last_n_steps,
        save_last_n_steps_state=ns.save_last_n_steps_state,
        save_state=ns.save_state,
        save_state_on_train_end=ns.save_state_on_train_end,
        resume=ns.resume,
        max_train_steps=ns.max_train_steps,
        max_train_epochs=ns.max_train_epochs,
        save_n_epoch_ratio=ns.save_n_epoch_ratio,
        seed=random.randint(0, 2**32 - 1) if ns.seed is None else ns.seed,
        gradient_accumulation_steps=ns.gradient_accumulation_steps,
        mixed_precision=ns.mixed_precision,
        full_fp16=ns.full_fp16,
        full_bf16=ns.full_bf16,
        gradient_checkpointing=ns.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing,
        cpu=ns.cpu,
        logging_dir=ns.logging_dir,
        log_with=log_with,
        log_prefix=ns.log_prefix,
        log_tracker_name=ns.log_tracker_name,
        log_tracker_config=tracker_config,
        wandb_run_name=ns.wandb_run_name,
        wandb_api_key=ns.wandb_api_key,
        log_config=run_config,
        log_every_n_steps=ns.log_every_n_steps,
        log_tflops=getattr(ns, "log_tflops", None),
        compile=_compile_options(ns),
        highvram=ns.highvram,
        lowram=ns.lowram,
        profile_steps=ns.profile_steps or ns.profile_microbatches,
        profile_microbatches=ns.profile_microbatches,
        profiler_trace_dir=ns.profiler_trace_dir,
        profiler_trace_steps=_trace_steps(ns),
        validate_every_n_steps=ns.validate_every_n_steps,
        validate_every_n_epochs=ns.validate_every_n_epochs,
        max_validation_steps=ns.max_validation_steps,
        ddp_timeout=ns.ddp_timeout,
        ddp_gradient_as_bucket_view=ns.ddp_gradient_as_bucket_view,
        ddp_static_graph=ns.ddp_static_graph,
        deepspeed=deepspeed_options_from_args(ns),
    )


def _trace_steps(ns: argparse.Namespace) -> tuple[int, int]:
    try:
        return parse_step_range(ns.profiler_trace_steps)
    except ValueError as e:
        raise ConfigError(f"--profiler_trace_steps: {e}") from None


def _compile_options(ns: argparse.Namespace) -> CompileOptions:
    opts = CompileOptions(ns.torch_compile, ns.dynamo_backend, ns.dynamo_mode, ns.dynamo_fullgraph, ns.dynamo_dynamic)
    if not opts.torch_compile:
        return opts
    backends = dynamo_backends()
    if opts.dynamo_backend not in backends:
        raise ConfigError(f"--dynamo_backend: expected one of {', '.join(backends)}, got {ns.dynamo_backend!r}")
    if opts.dynamo_mode and opts.dynamo_backend != "inductor":
        raise ConfigError(f"--dynamo_mode {opts.dynamo_mode}: an inductor option, but --dynamo_backend is "
                          f"{opts.dynamo_backend}")
    return opts
