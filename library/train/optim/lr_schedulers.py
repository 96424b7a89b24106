"""Learning-rate schedules by sd-scripts' `--lr_scheduler` names.

Every built-in schedule is a `LambdaLR` whose multiplier is a pure function of
the step number, so `scheduler.load_state_dict(saved)` after a resume continues
exactly where the run stopped (sd-scripts' cosine_with_restarts and
warmup_stable_decay do not, issues #141 and #1653). The formulas follow the
transformers schedules of the same names; past the last step a schedule stays
at its final value instead of rising again.
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.optim.lr_scheduler import LambdaLR

from library.core.errors import ConfigError
from library.train.optim.optimizers import (
    is_schedule_free,
    parse_literal_args,
    unwrap_optimizer,
)

StepCount = Union[int, float, str, None]
LrLambda = Callable[[int], float]
logger = logging.getLogger(__name__)

SCHEDULERS = (
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "cosine_with_min_lr",
    "polynomial", "inverse_sqrt", "warmup_stable_decay", "piecewise_constant", "rex", "adafactor",
)
# Schedulers that have no warmup phase; a warmup given with them is a mistake, not a no-op.
_NO_WARMUP = ("constant", "piecewise_constant", "adafactor")
# Extra --lr_scheduler_args each built-in schedule understands.
_EXTRA_ARGS = {
    "cosine": ("num_cycles",),
    "polynomial": ("lr_end",),
    "cosine_with_min_lr": ("min_lr",),
    "warmup_stable_decay": ("warmup_type", "decay_type"),
    "piecewise_constant": ("step_rules",),
}


@dataclass
class SchedulerOptions:
    """The scheduler flags (library/cli/optimizer.py translates them)."""
    lr_scheduler: str = "constant"
    lr_warmup_steps: StepCount = 0  # int, ratio < 1 of the total, or "N%"
    lr_decay_steps: StepCount = 0  # same forms (warmup_stable_decay)
    lr_scheduler_num_cycles: int = 1
    lr_scheduler_power: float = 1.0
    lr_scheduler_timescale: Optional[int] = None
    lr_scheduler_min_lr_ratio: Optional[float] = None
    lr_scheduler_type: str = ""  # a custom scheduler class ("module.Class"; bare names are torch.optim.lr_scheduler)
    lr_scheduler_args: dict[str, Any] = field(default_factory=dict)


def parse_scheduler_args(items) -> dict[str, Any]:
    """Parse --lr_scheduler_args key=value items (Python literals; step_rules may be unquoted)."""
    return parse_literal_args(items, "--lr_scheduler_args", raw_string_keys=("step_rules", "warmup_type", "decay_type"))


def resolve_steps(value: StepCount, total_steps: int, flag: str = "--lr_warmup_steps") -> int:
    """A step count given as an int, a ratio below 1 of `total_steps`, or a percentage "N%"."""
    if value is None or value == "":
        return 0
    raw = value
    if isinstance(value, str):
        text = value.strip()
        try:
            if text.endswith("%"):
                pct = float(text[:-1])
                if not 0 <= pct <= 100:
                    raise ValueError
                return int(total_steps * pct / 100)
            value = float(text) if any(c in text for c in ".eE") else int(text)
        except ValueError:
            raise ConfigError(f"{flag}: expected a step count, a ratio below 1 or a percentage like 10%, got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{flag}: expected a step count, a ratio below 1 or a percentage like 10%, got {raw!r}")
    if isinstance(value, float):
        if value < 1:
            return int(value * total_steps)
        if not value.is_integer():
            raise ConfigError(f"{flag}: expected a whole step count or a ratio below 1, got {raw!r}")
    return int(value)


# --- schedule shapes (multipliers of the initial lr as functions of the step) -------------


def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _progress(step: int, start: int, length: int) -> float:
    return min(1.0, max(0.0, (step - start) / max(1, length)))


def _floor(factor: float, min_ratio: float) -> float:
    return min_ratio + (1.0 - min_ratio) * factor


def parse_step_rules(rules: str) -> tuple[list[tuple[int, float]], float]:
    """"1:10,0.1:20,0.01" -> ([(10, 1.0), (20, 0.1)], 0.01): multiplier 1 before step 10, 0.1 before 20, then 0.01."""
    try:
        parts = [p.strip() for p in str(rules).split(",")]
        steps = sorted((int(s), float(v)) for v, s in (p.split(":") for p in parts[:-1]))
        return steps, float(parts[-1])
    except ValueError:
        raise ConfigError(
            f"--lr_scheduler_args step_rules: expected 'multiplier:step,...,final_multiplier' like '1:10,0.1:20,0.01', got {rules!r}"
        ) from None


def _lambdas(name: str, o: SchedulerOptions, total: int, warmup: int, decay: int, base_lrs: list[float]) -> LrLambda | list[LrLambda]:
    extra = o.lr_scheduler_args
    min_ratio = o.lr_scheduler_min_lr_ratio or 0.0
    after = max(1, total - warmup)

    def with_warmup(shape: Callable[[int], float]) -> LrLambda:
        return lambda s: _warmup(s, warmup) if s < warmup else shape(s)

    if name == "constant":
        return lambda s: 1.0
    if name == "constant_with_warmup":
        return with_warmup(lambda s: 1.0)
    if name == "linear":
        return with_warmup(lambda s: max(0.0, (total - s) / after))
    if name == "cosine":
        cycles = float(extra.get("num_cycles", 0.5))
        return with_warmup(lambda s: 0.5 * (1 + math.cos(math.pi * 2 * cycles * _progress(s, warmup, after))))
    if name == "cosine_with_restarts":
        cycles = o.lr_scheduler_num_cycles

        def restarts(s: int) -> float:
            p = _progress(s, warmup, after)
            if p >= 1.0:
                return min_ratio
            return _floor(0.5 * (1 + math.cos(math.pi * ((cycles * p) % 1.0))), min_ratio)

        return with_warmup(restarts)
    if name == "cosine_with_min_lr":
        if o.lr_scheduler_min_lr_ratio is None and "min_lr" not in extra:
            raise ConfigError("--lr_scheduler cosine_with_min_lr: needs --lr_scheduler_min_lr_ratio (or --lr_scheduler_args min_lr=...)")
        half_cycles = o.lr_scheduler_num_cycles / 2  # sd-scripts passes num_cycles / 2: 1 cycle = one half cosine
        ratios = [min_ratio if o.lr_scheduler_min_lr_ratio is not None else float(extra["min_lr"]) / lr if lr else 0.0
                  for lr in base_lrs]
        return [with_warmup(lambda s, r=r: _floor(0.5 * (1 + math.cos(math.pi * 2 * half_cycles * _progress(s, warmup, after))), r))
                for r in ratios]
    if name == "polynomial":
        lr_end, power = float(extra.get("lr_end", 1e-7)), o.lr_scheduler_power

        def poly(lr_init: float) -> LrLambda:
            if lr_init == 0:
                return lambda s: 0.0
            if lr_init <= lr_end:
                raise ConfigError(f"--lr_scheduler polynomial: lr_end ({lr_end}) must be below the learning rate ({lr_init})")
            return with_warmup(lambda s: ((lr_init - lr_end) * (1 - _progress(s, warmup, after)) ** power + lr_end) / lr_init)

        return [poly(lr) for lr in base_lrs]  # per group: lr_end is an absolute lr
    if name == "inverse_sqrt":
        timescale = o.lr_scheduler_timescale or warmup or 10_000
        return with_warmup(lambda s: 1.0 / math.sqrt((s + timescale - warmup) / timescale))
    if name == "warmup_stable_decay":
        return _wsd_lambda(o, total, warmup, decay, min_ratio)
    if name == "piecewise_constant":
        if "step_rules" not in extra:
            raise ConfigError("--lr_scheduler piecewise_constant: needs --lr_scheduler_args step_rules='1:10,0.1:20,0.01'")
        rules, last = parse_step_rules(extra["step_rules"])
        return lambda s: next((v for step, v in rules if s < step), last)
    if name == "rex":
        # REX (Chen, Wolfe, Kyrillidis, "REX: Revisiting Budgeted Training with an Improved
        # Schedule", MLSys 2022, eq. 3): with progress z = t / T the multiplier is
        # (1 - z) / (1/2 + (1 - z) / 2) = (1 - z) / (1 - z/2), held near 1 longer than linear decay.
        def rex(s: int) -> float:
            z = _progress(s, warmup, after)
            return _floor((1 - z) / (1 - z / 2), min_ratio)

        return with_warmup(rex)
    raise ConfigError(f"--lr_scheduler: expected one of {', '.join(SCHEDULERS)}, got {name!r}")


def _wsd_lambda(o: SchedulerOptions, total: int, warmup: int, decay: int, min_ratio: float) -> LrLambda:
    """Warmup-stable-decay: warmup, hold at 1 until `decay` steps remain, decay to min_lr_ratio."""
    if warmup + decay > total:
        raise ConfigError(f"--lr_warmup_steps ({warmup}) + --lr_decay_steps ({decay}) exceed the {total} training steps")
    warmup_type = o.lr_scheduler_args.get("warmup_type", "linear")
    decay_type = o.lr_scheduler_args.get("decay_type", "cosine")
    for key, value in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if value not in ("linear", "cosine", "1-sqrt"):
            raise ConfigError(f"--lr_scheduler_args {key}: expected linear, cosine or 1-sqrt, got {value!r}")
    half_cycles = o.lr_scheduler_num_cycles / 2
    decay_start = total - decay

    def shape(kind: str, p: float, rising: bool) -> float:
        if kind == "linear":
            return p if rising else 1 - p
        if kind == "cosine":
            return 0.5 * (1 - math.cos(math.pi * p)) if rising else 0.5 * (1 + math.cos(math.pi * 2 * half_cycles * p))
        return 1 - math.sqrt(1 - p) if rising else 1 - math.sqrt(p)

    def wsd(s: int) -> float:
        if s < warmup:
            return max(0.0, _floor(shape(warmup_type, s / max(1, warmup), True), min_ratio))
        if s < decay_start:
            return 1.0
        if s < total:
            return max(0.0, _floor(shape(decay_type, (s - decay_start) / max(1, decay), False), min_ratio))
        return min_ratio

    return wsd


class AdafactorLR(LambdaLR):
    """Reports the step size Adafactor (relative_step=True) chose for itself; it sets no lr.

    Before the first step it reports `initial_lr` (the --learning_rate).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, initial_lr: float):
        for group in optimizer.param_groups:
            group["initial_lr"] = initial_lr
        super().__init__(optimizer, lambda _: 1.0)

    def get_lr(self) -> list[float]:
        opt = self.optimizer
        lrs = []
        for group, base in zip(opt.param_groups, self.base_lrs):
            state = opt.state.get(group["params"][0], {})
            lrs.append(opt._get_lr(group, state) if "step" in state else base)
        return lrs


def _is_relative_step_adafactor(optimizer) -> bool:
    inner = unwrap_optimizer(optimizer)
    return bool(inner.param_groups and inner.param_groups[0].get("relative_step")) and hasattr(inner, "_get_lr")


def _custom_scheduler(optimizer, o: SchedulerOptions):
    module_name, _, cls_name = o.lr_scheduler_type.rpartition(".")
    module_name = module_name or "torch.optim.lr_scheduler"
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--lr_scheduler_type {o.lr_scheduler_type}: cannot import it: {e}") from None
    try:
        return cls(optimizer, **o.lr_scheduler_args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--lr_scheduler_args: {cls_name} rejected {o.lr_scheduler_args}: {str(e).splitlines()[0]}") from None


def create_scheduler(optimizer: torch.optim.Optimizer, options: SchedulerOptions, total_steps: int, descriptor=None):
    """The lr scheduler for `total_steps` scheduler steps (max_train_steps x processes in sd-scripts).

    `descriptor` (from create_optimizer) switches to the constant schedule for
    schedule-free optimizers and to the adafactor schedule for Adafactor with relative_step.
    """
    name = options.lr_scheduler or "constant"
    if descriptor is not None and descriptor.lr_scheduler_override:
        name = descriptor.lr_scheduler_override
    elif _is_relative_step_adafactor(optimizer) and not name.startswith("adafactor"):
        # Adafactor with relative_step sets its own step size; sd-scripts switches to this schedule too.
        logger.info(f"--lr_scheduler {name}: replaced by the adafactor schedule (Adafactor with relative_step=True)")
        name = "adafactor"
    warmup = resolve_steps(options.lr_warmup_steps, total_steps, "--lr_warmup_steps")
    decay = resolve_steps(options.lr_decay_steps, total_steps, "--lr_decay_steps")

    if (descriptor is not None and descriptor.schedule_free) or is_schedule_free(optimizer):
        return LambdaLR(optimizer, lambda _: 1.0)  # schedule-free optimizers schedule themselves
    if options.lr_scheduler_type:
        if warmup:
            raise ConfigError(f"--lr_warmup_steps: not used by --lr_scheduler_type {options.lr_scheduler_type}; set it to 0")
        return _custom_scheduler(optimizer, options)

    base_name, _, arg = name.partition(":")
    if base_name not in SCHEDULERS:
        raise ConfigError(f"--lr_scheduler: expected one of {', '.join(SCHEDULERS)}, got {name!r}")
    if warmup and base_name in _NO_WARMUP:
        hint = "; use constant_with_warmup" if base_name == "constant" else ""
        raise ConfigError(f"--lr_warmup_steps: --lr_scheduler {base_name} has no warmup{hint}")
    if warmup > total_steps:
        raise ConfigError(f"--lr_warmup_steps: {warmup} is more than the {total_steps} training steps")
    unknown = set(options.lr_scheduler_args) - set(_EXTRA_ARGS.get(base_name, ()))
    if unknown:
        accepted = ", ".join(_EXTRA_ARGS.get(base_name, ())) or "none"
        raise ConfigError(f"--lr_scheduler_args: {', '.join(sorted(unknown))} not used by --lr_scheduler {base_name} (accepted: {accepted})")

    if base_name == "adafactor":
        if not _is_relative_step_adafactor(optimizer):
            raise ConfigError("--lr_scheduler adafactor: needs --optimizer_type AdaFactor with relative_step=True")
        try:
            initial_lr = float(arg) if arg else float(optimizer.param_groups[0].get("initial_lr") or 0.0)
        except ValueError:
            raise ConfigError(f"--lr_scheduler: expected adafactor or adafactor:<lr>, got {name!r}") from None
        return AdafactorLR(optimizer, initial_lr)

    base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    lambdas = _lambdas(base_name, options, total_steps, warmup, decay, base_lrs)
    return LambdaLR(optimizer, lambdas)


# --- logging names ------------------------------------------------------------------------


def lr_log_names(descriptions: Optional[Sequence[Optional[str]]], num_groups: Optional[int] = None,
                 text_encoder_first: bool = False) -> list[str]:
    """TensorBoard tag per param group: "lr/<description>" as sd-scripts writes them.

    Without descriptions: the first group is "textencoder" when `text_encoder_first`;
    the rest is "unet" if one group remains, else "group<i>" (i counted after the text encoder).
    Repeated descriptions get " <i>" appended so no curve overwrites another.
    """
    if descriptions is None:
        n = num_groups or 0
        offset = 1 if text_encoder_first and n > 0 else 0
        rest = n - offset
        descriptions = (["textencoder"] if offset else []) + (
            ["unet"] if rest == 1 else [f"group{i}" for i in range(rest)])
    names, seen = [], set()
    for i, desc in enumerate(descriptions):
        desc = desc or f"group{i}"
        if desc in seen:
            desc = f"{desc} {i}"
        seen.add(desc)
        names.append(f"lr/{desc}")
    return names


def lr_logs(scheduler, optimizer: torch.optim.Optimizer, names: Sequence[str], adaptive: bool = False) -> dict[str, float]:
    """{"lr/<desc>": lr, ...} for one step, plus "lr/d*lr/<desc>" = d * lr for D-Adaptation / Prodigy groups."""
    logs: dict[str, float] = {}
    for i, (name, lr) in enumerate(zip(names, scheduler.get_last_lr())):
        logs[name] = float(lr)
        group = optimizer.param_groups[i]
        if adaptive and "d" in group:
            logs["lr/d*lr/" + name[len("lr/"):]] = float(group["d"]) * float(group["lr"])
    return logs
