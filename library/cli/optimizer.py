"""Optimizer and learning-rate scheduler flags (sd-scripts names and defaults)."""

from __future__ import annotations

import argparse
import os

from library.core.errors import ConfigError
from library.train.lr_schedulers import (
    SCHEDULERS,
    SchedulerOptions,
    parse_scheduler_args,
    resolve_steps,
)
from library.train.optimizers import (
    OptimizerOptions,
    parse_optimizer_args,
    resolve_optimizer_type,
)


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --optimizer_type, --learning_rate, ... and the --lr_scheduler* flags."""
    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer_type", type=str, default="",
                   help="AdamW (default), AdamW8bit, PagedAdamW, PagedAdamW8bit, PagedAdamW32bit, Lion, Lion8bit, "
                        "PagedLion8bit, SGDNesterov, SGDNesterov8bit, DAdaptation, DAdaptAdaGrad, DAdaptAdam, DAdaptAdan, "
                        "DAdaptAdanIP, DAdaptLion, DAdaptSGD, Prodigy, AdaFactor, RAdamScheduleFree, AdamWScheduleFree, "
                        "SGDScheduleFree, or a class path like torch.optim.RMSprop")
    g.add_argument("--learning_rate", type=float, default=2e-6, help="learning rate (default 2e-6)")
    g.add_argument("--scale_lr", action="store_true",
                   help="multiply --learning_rate by processes x --train_batch_size x --gradient_accumulation_steps "
                        "(the lr recorded in the metadata is the product)")
    g.add_argument("--optimizer_args", type=str, default=None, nargs="*",
                   help='optimizer keyword arguments as Python literals: "weight_decay=0.01" "betas=(0.9,0.99)"')
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="clip gradients to this norm; 0 turns clipping off")
    g.add_argument("--use_8bit_adam", action="store_true", help="legacy: same as --optimizer_type AdamW8bit")
    g.add_argument("--use_lion_optimizer", action="store_true", help="legacy: same as --optimizer_type Lion")

    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument("--lr_scheduler", type=str, default="constant", help=", ".join(SCHEDULERS) + " (default constant)")
    g.add_argument("--lr_warmup_steps", type=str, default="0",
                   help="warmup steps: a count, a ratio of the total below 1 (0.05), or a percentage (5%%)")
    g.add_argument("--lr_decay_steps", type=str, default="0",
                   help="decay steps of warmup_stable_decay, in the same forms as --lr_warmup_steps")
    g.add_argument("--lr_scheduler_num_cycles", type=int, default=1, help="cosine restarts / half-cosine cycles")
    g.add_argument("--lr_scheduler_power", type=float, default=1.0, help="polynomial decay power")
    g.add_argument("--lr_scheduler_timescale", type=int, default=None,
                   help="inverse_sqrt timescale (default: the warmup steps, or 10000)")
    g.add_argument("--lr_scheduler_min_lr_ratio", type=float, default=None,
                   help="lowest lr as a fraction of the initial lr (cosine_with_min_lr, cosine_with_restarts, "
                        "warmup_stable_decay, rex)")
    g.add_argument("--lr_scheduler_type", type=str, default="",
                   help="custom scheduler class, e.g. torch.optim.lr_scheduler.StepLR (replaces --lr_scheduler)")
    g.add_argument("--lr_scheduler_args", type=str, default=None, nargs="*",
                   help='keyword arguments of the scheduler as Python literals: "step_size=100" "gamma=0.5"')


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
    if not getattr(ns, "scale_lr", False):
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
    if not ns.learning_rate >= 0:
        raise ConfigError(f"--learning_rate: expected a number >= 0, got {ns.learning_rate}")
    if ns.max_grad_norm is not None and ns.max_grad_norm < 0:
        raise ConfigError(f"--max_grad_norm: expected a number >= 0 (0 = no clipping), got {ns.max_grad_norm}")
    options = OptimizerOptions(
        optimizer_type=ns.optimizer_type or "",
        learning_rate=scaled_learning_rate(ns),
        optimizer_args=parse_optimizer_args(ns.optimizer_args),
        max_grad_norm=ns.max_grad_norm or 0.0,
        use_8bit_adam=bool(getattr(ns, "use_8bit_adam", False)),
        use_lion_optimizer=bool(getattr(ns, "use_lion_optimizer", False)),
    )
    options.optimizer_type = resolve_optimizer_type(options)  # legacy flags folded in; conflicts raise here
    options.use_8bit_adam = options.use_lion_optimizer = False
    return options


def scheduler_options_from_args(ns: argparse.Namespace) -> SchedulerOptions:
    """SchedulerOptions from the parsed flags; the step-count forms are checked now, resolved at setup."""
    name = (ns.lr_scheduler or "constant").strip()
    if name not in SCHEDULERS and not name.startswith("adafactor:"):
        raise ConfigError(f"--lr_scheduler: expected one of {', '.join(SCHEDULERS)}, got {name!r}")
    for flag, value in (("--lr_warmup_steps", ns.lr_warmup_steps), ("--lr_decay_steps", ns.lr_decay_steps)):
        resolve_steps(value, 1000, flag)  # form check only; the real total is known at setup
    if ns.lr_scheduler_num_cycles is not None and ns.lr_scheduler_num_cycles < 1:
        raise ConfigError(f"--lr_scheduler_num_cycles: expected an integer >= 1, got {ns.lr_scheduler_num_cycles}")
    if ns.lr_scheduler_timescale is not None and ns.lr_scheduler_timescale < 1:
        raise ConfigError(f"--lr_scheduler_timescale: expected an integer >= 1, got {ns.lr_scheduler_timescale}")
    ratio = ns.lr_scheduler_min_lr_ratio
    if ratio is not None and not 0 <= ratio <= 1:
        raise ConfigError(f"--lr_scheduler_min_lr_ratio: expected a number between 0 and 1, got {ratio}")
    return SchedulerOptions(
        lr_scheduler=name,
        lr_warmup_steps=ns.lr_warmup_steps,
        lr_decay_steps=ns.lr_decay_steps,
        lr_scheduler_num_cycles=ns.lr_scheduler_num_cycles or 1,
        lr_scheduler_power=ns.lr_scheduler_power,
        lr_scheduler_timescale=ns.lr_scheduler_timescale,
        lr_scheduler_min_lr_ratio=ratio,
        lr_scheduler_type=ns.lr_scheduler_type or "",
        lr_scheduler_args=parse_scheduler_args(ns.lr_scheduler_args),
    )
