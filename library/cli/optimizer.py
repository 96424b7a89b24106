"""Optimizer and learning-rate scheduler flags (sd-scripts names and defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

from library.cli.options import LEARNING_RATE, RATE, Range, add_flags, at_least, flag, flag_specs, settings_from
from library.core.errors import ConfigError
from library.train.optim.lr_schedulers import (
    SCHEDULERS,
    SchedulerOptions,
    parse_scheduler_args,
    resolve_steps,
)
from library.train.optim.optimizers import (
    OptimizerOptions,
    parse_optimizer_args,
    resolve_optimizer_type,
)


@dataclass
class OptimizerFlags:
    flag_group: ClassVar[str] = "optimizer"
    optimizer_type: str = flag("", "AdamW (default), AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Lion, "
                                   "Lion8bit, PagedLion8bit, SGDNesterov, SGDNesterov8bit, DAdaptation, "
                                   "DAdaptAdaGrad, DAdaptAdam, DAdaptAdan, DAdaptAdanIP, DAdaptLion, DAdaptSGD, "
                                   "Prodigy, AdaFactor, RAdamScheduleFree, AdamWScheduleFree, SGDScheduleFree, or a "
                                   "class path like torch.optim.RMSprop")
    learning_rate: float = flag(2e-06, "learning rate (default 2e-6)", range=LEARNING_RATE)
    scale_lr: bool = flag(False, "multiply --learning_rate by processes x --train_batch_size x "
                                 "--gradient_accumulation_steps (the lr recorded in the metadata is the product)")
    optimizer_args: Optional[list[str]] = flag(None, "optimizer keyword arguments as Python literals: "
                                                     '"weight_decay=0.01" "betas=(0.9,0.99)"')
    max_grad_norm: float = flag(1.0, "clip gradients to this norm; 0 turns clipping off",
                                     range=Range(lo=0, note="0 = no clipping"))
    use_8bit_adam: bool = flag(False, "legacy: same as --optimizer_type AdamW8bit")
    use_lion_optimizer: bool = flag(False, "legacy: same as --optimizer_type Lion")
    decoupled_weight_decay: bool = flag(False, "apply weight decay to the weights apart from the gradient (AdamW's "
                                               "rule) through the optimizer's own switch: Adam's "
                                               "decoupled_weight_decay, Prodigy's / D-Adaptation's decouple")


@dataclass
class SchedulerFlags:
    flag_group: ClassVar[str] = "learning-rate schedule"
    lr_scheduler: str = flag("constant", ", ".join(SCHEDULERS) + " (default constant)")
    lr_warmup_steps: str = flag("0", "warmup steps: a count, a ratio of the total below 1 (0.05), or a percentage "
                                     "(5%)")
    lr_decay_steps: str = flag("0", "decay steps of warmup_stable_decay, in the same forms as --lr_warmup_steps")
    lr_scheduler_num_cycles: int = flag(1, "cosine restarts / half-cosine cycles", range=at_least(1))
    lr_scheduler_power: float = flag(1.0, "polynomial decay power", range=Range(lo=0))
    lr_scheduler_timescale: Optional[int] = flag(None, "inverse_sqrt timescale (default: the warmup steps, or 10000)",
                                                       range=at_least(1))
    lr_scheduler_min_lr_ratio: Optional[float] = flag(None, "lowest lr as a fraction of the initial lr "
                                                            "(cosine_with_min_lr, cosine_with_restarts, "
                                                            "warmup_stable_decay, rex)", range=RATE)
    lr_scheduler_type: str = flag("", "custom scheduler class, e.g. torch.optim.lr_scheduler.StepLR (replaces "
                                      "--lr_scheduler)")
    lr_scheduler_args: Optional[list[str]] = flag(None, "keyword arguments of the scheduler as Python literals: "
                                                        '"step_size=100" "gamma=0.5"')


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --optimizer_type, --learning_rate, ... and the --lr_scheduler* flags."""
    add_flags(parser, flag_specs(OptimizerFlags) + flag_specs(SchedulerFlags))


# Learning rates of single parts: --scale_lr scales --learning_rate only, so it refuses to run beside them.
_PART_LR_FLAGS = ("unet_lr", "text_encoder_lr", "learning_rate_te", "learning_rate_te1", "learning_rate_te2",
                  "learning_rate_te3")


def num_processes() -> int:
    """How many training processes this launch runs: accelerate / torchrun's WORLD_SIZE, else 1."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(value))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE: expected an integer, got {value!r}") from None


def scaled_learning_rate(ns: argparse.Namespace) -> float:
    """--learning_rate, times processes x --train_batch_size x --gradient_accumulation_steps with --scale_lr."""
    lr = ns.learning_rate
    if not ns.scale_lr:
        return lr
    given = [f"--{name}" for name in _PART_LR_FLAGS if getattr(ns, name, None) not in (None, [])]
    if given:
        raise ConfigError(f"--scale_lr: scales --learning_rate only, and {', '.join(given)} would stay unscaled; "
                          "scale those yourself or drop --scale_lr")
    batch = getattr(ns, "train_batch_size", 1) or 1
    accumulation = getattr(ns, "gradient_accumulation_steps", 1) or 1
    return lr * num_processes() * batch * accumulation


def optimizer_options_from_args(ns: argparse.Namespace) -> OptimizerOptions:
    """OptimizerOptions from the parsed flags; bad values raise ConfigError naming the flag.

    `learning_rate` is the effective one: scaled by --scale_lr (scaled_learning_rate).
    """
    options = settings_from(OptimizerOptions, ns, optimizer_type=ns.optimizer_type or "",
                            learning_rate=scaled_learning_rate(ns),
                            optimizer_args=parse_optimizer_args(ns.optimizer_args),
                            max_grad_norm=ns.max_grad_norm or 0.0)
    options.optimizer_type = resolve_optimizer_type(options)  # legacy flags folded in; conflicts raise here
    options.use_8bit_adam = options.use_lion_optimizer = False
    return options


def scheduler_options_from_args(ns: argparse.Namespace) -> SchedulerOptions:
    """SchedulerOptions from the parsed flags; the step-count forms are checked now, resolved at setup."""
    name = (ns.lr_scheduler or "constant").strip()
    if name not in SCHEDULERS and not name.startswith("adafactor:"):
        raise ConfigError(f"--lr_scheduler: expected one of {', '.join(SCHEDULERS)}, got {name!r}")
    for flag_name, value in (("--lr_warmup_steps", ns.lr_warmup_steps), ("--lr_decay_steps", ns.lr_decay_steps)):
        resolve_steps(value, 1000, flag_name)  # form check only; the real total is known at setup
    return settings_from(SchedulerOptions, ns, lr_scheduler=name,
                         lr_scheduler_num_cycles=ns.lr_scheduler_num_cycles or 1,
                         lr_scheduler_type=ns.lr_scheduler_type or "",
                         lr_scheduler_args=parse_scheduler_args(ns.lr_scheduler_args))
