"""Optimizer creation from the sd-scripts `--optimizer_type` names (or any dotted class path).

Optional packages (bitsandbytes, lion-pytorch, dadaptation, prodigyopt,
schedulefree) are imported only when their optimizer is asked for; a missing
one is a one-line ConfigError with the pip command that fixes it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from library.core.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class OptimizerOptions:
    """The optimizer flags (library/cli/optimizer.py translates them)."""
    optimizer_type: str = "AdamW"
    learning_rate: float = 2e-6
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    max_grad_norm: float = 1.0
    use_8bit_adam: bool = False  # legacy: same as --optimizer_type AdamW8bit
    use_lion_optimizer: bool = False  # legacy: same as --optimizer_type Lion
    decoupled_weight_decay: bool = False  # --decoupled_weight_decay (decoupled_weight_decay_args)


@dataclass(frozen=True)
class _Spec:
    module: str
    cls: str
    package: Optional[str]  # pip name when not always installed
    defaults: tuple[tuple[str, Any], ...] = ()  # kwargs added unless the user set them
    adaptive: bool = False  # D-Adaptation / Prodigy: lr is a multiplier of the learned step (d)


_BNB = "bitsandbytes"
_DADAPT = "dadaptation"
_NESTEROV = (("momentum", 0.9), ("nesterov", True))

# Keys are the lower-cased --optimizer_type names; values say where the class lives.
OPTIMIZERS: dict[str, _Spec] = {
    "adamw": _Spec("torch.optim", "AdamW", None),
    "adamw8bit": _Spec("bitsandbytes.optim", "AdamW8bit", _BNB),
    "pagedadamw": _Spec("bitsandbytes.optim", "PagedAdamW", _BNB),
    "pagedadamw8bit": _Spec("bitsandbytes.optim", "PagedAdamW8bit", _BNB),
    "pagedadamw32bit": _Spec("bitsandbytes.optim", "PagedAdamW32bit", _BNB),
    "lion": _Spec("lion_pytorch", "Lion", "lion-pytorch"),
    "lion8bit": _Spec("bitsandbytes.optim", "Lion8bit", _BNB),
    "pagedlion8bit": _Spec("bitsandbytes.optim", "PagedLion8bit", _BNB),
    "sgdnesterov": _Spec("torch.optim", "SGD", None, _NESTEROV),
    "sgdnesterov8bit": _Spec("bitsandbytes.optim", "SGD8bit", _BNB, _NESTEROV),
    "dadaptation": _Spec("dadaptation.experimental", "DAdaptAdamPreprint", _DADAPT, adaptive=True),
    "dadaptadampreprint": _Spec("dadaptation.experimental", "DAdaptAdamPreprint", _DADAPT, adaptive=True),
    "dadaptadagrad": _Spec("dadaptation", "DAdaptAdaGrad", _DADAPT, adaptive=True),
    "dadaptadam": _Spec("dadaptation", "DAdaptAdam", _DADAPT, adaptive=True),
    "dadaptadan": _Spec("dadaptation", "DAdaptAdan", _DADAPT, adaptive=True),
    "dadaptadanip": _Spec("dadaptation.experimental", "DAdaptAdanIP", _DADAPT, adaptive=True),
    "dadaptlion": _Spec("dadaptation", "DAdaptLion", _DADAPT, adaptive=True),
    "dadaptsgd": _Spec("dadaptation", "DAdaptSGD", _DADAPT, adaptive=True),
    "prodigy": _Spec("prodigyopt", "Prodigy", "prodigyopt", adaptive=True),
    "adafactor": _Spec("transformers.optimization", "Adafactor", "transformers"),
    "radamschedulefree": _Spec("schedulefree", "RAdamScheduleFree", "schedulefree"),
    "adamwschedulefree": _Spec("schedulefree", "AdamWScheduleFree", "schedulefree"),
    "sgdschedulefree": _Spec("schedulefree", "SGDScheduleFree", "schedulefree"),
}


@dataclass
class OptimizerDescriptor:
    """What the loop and the metadata need to know about the created optimizer."""

    optimizer_type: str  # the resolved --optimizer_type (legacy flags applied), e.g. "AdamW8bit"
    name: str  # "module.Class" of the optimizer
    kwargs: dict[str, Any]  # the keyword arguments it was built with (besides params and lr)
    ss_optimizer: str  # "torch.optim.adamw.AdamW(weight_decay=0.01)" for ss_optimizer metadata
    adaptive: bool = False  # D-Adaptation / Prodigy: log d*lr
    schedule_free: bool = False  # call optimizer.train() / .eval() around training / sampling
    lr_scheduler_override: Optional[str] = None  # "adafactor:<lr>" when Adafactor sets its own step size


# --- --optimizer_args / --lr_scheduler_args ----------------------------------------


def parse_literal_args(items: Optional[Iterable[str]], flag: str, raw_string_keys: Iterable[str] = ()) -> dict[str, Any]:
    """Parse ["key=value", ...] with each value a Python literal (ast.literal_eval).

    `raw_string_keys` are keys whose value may also be given unquoted (kept as the raw string).
    """
    out: dict[str, Any] = {}
    for item in items or ():
        if isinstance(item, dict):  # from a --config_file TOML table
            out.update(item)
            continue
        key, sep, text = str(item).partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            raise ConfigError(f"{flag}: expected key=value, got {item!r}")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            if key in raw_string_keys:
                out[key] = text
                continue
            raise ConfigError(
                f"{flag}: {item!r}: value {text!r} is not a Python literal (numbers, True/False, tuples; quote strings: {key}='{text}')"
            ) from None
    return out


def parse_optimizer_args(items: Optional[Iterable[str]]) -> dict[str, Any]:
    """Parse --optimizer_args ("betas=(0.9,0.99)", "weight_decay=0.01", "decouple=True") into a dict."""
    return parse_literal_args(items, "--optimizer_args")


# --- creation ------------------------------------------------------------------------


def resolve_optimizer_type(options: OptimizerOptions) -> str:
    """--optimizer_type after the legacy --use_8bit_adam / --use_lion_optimizer flags have been applied."""
    given = (options.optimizer_type or "").strip()
    unset = given == "" or given.lower() == "adamw"
    if options.use_8bit_adam and options.use_lion_optimizer:
        raise ConfigError("--use_8bit_adam and --use_lion_optimizer: give only one (or use --optimizer_type)")
    for flag, name in (("--use_8bit_adam", "AdamW8bit"), ("--use_lion_optimizer", "Lion")):
        if getattr(options, flag[2:]):
            if not unset:
                raise ConfigError(f"{flag} and --optimizer_type {given}: give only one")
            return name
    return given or "AdamW"


def _import_class(module: str, cls: str, optimizer_type: str, package: Optional[str]):
    top = module.split(".")[0]
    try:
        importlib.import_module(top)  # the package itself first: a submodule already imported says nothing of it
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == top:  # the package itself is missing, not one of its dependencies
            pip_name = package or top
            raise ConfigError(f"--optimizer_type {optimizer_type} needs {pip_name}: pip install {pip_name}"
                              + (" (or, in this repository: pip install .[optim])" if package else "")) from None
        raise ConfigError(f"--optimizer_type {optimizer_type}: cannot import {module}: {e}") from None
    except Exception as e:  # a package that is present but broken (e.g. no CUDA build of bitsandbytes)
        raise ConfigError(f"--optimizer_type {optimizer_type}: cannot import {module}: {str(e).splitlines()[0]}") from None
    found = getattr(mod, cls, None)
    if found is None:
        raise ConfigError(f"--optimizer_type {optimizer_type}: {module} has no class {cls}")
    return found


def _spec_for(optimizer_type: str) -> _Spec:
    spec = OPTIMIZERS.get(optimizer_type.lower())
    if spec is not None:
        return spec
    if "." in optimizer_type:
        module, _, cls = optimizer_type.rpartition(".")
        return _Spec(module, cls, None)
    if hasattr(torch.optim, optimizer_type):  # sd-scripts: a bare class name means torch.optim
        return _Spec("torch.optim", optimizer_type, None)
    raise ConfigError(
        f"--optimizer_type: unknown optimizer {optimizer_type!r}; expected one of "
        f"{', '.join(sorted(OPTIMIZERS))} (any case) or a dotted class path like torch.optim.RMSprop"
    )


def _group_lrs(param_groups: list, default_lr: float) -> list[float]:
    return [g.get("lr", default_lr) if isinstance(g, dict) else default_lr for g in param_groups]


def _check_kwargs(cls, kwargs: dict[str, Any]) -> None:
    """Name the bad key of --optimizer_args instead of surfacing a TypeError mid-setup."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        allowed = [k for k in params if k not in ("self", "params", "lr")]
        raise ConfigError(
            f"--optimizer_args: {cls.__name__} does not accept {', '.join(unknown)}; it accepts {', '.join(allowed)}"
        )


def _prepare_adafactor(param_groups: list, lr: float, kwargs: dict[str, Any]) -> tuple[Optional[float], Optional[str]]:
    """sd-scripts' Adafactor defaults: relative_step on (Adafactor picks its own step size,
    the lr only seeds the logged value) unless the user turns it off."""
    kwargs.setdefault("relative_step", True)
    if not kwargs["relative_step"] and kwargs.get("warmup_init", False):
        logger.info("Adafactor: warmup_init=True needs relative_step; setting relative_step=True")
        kwargs["relative_step"] = True
    if not kwargs["relative_step"]:
        if kwargs.get("clip_threshold", 1.0) != 1.0:
            logger.warning("Adafactor: clip_threshold=1.0 is recommended")
        return lr, None
    had_group_lr = False
    for group in param_groups:
        if isinstance(group, dict):
            had_group_lr = group.pop("lr", None) is not None or had_group_lr
    if had_group_lr:
        logger.warning("Adafactor with relative_step: per-group learning rates (unet_lr, text_encoder_lr) are ignored")
    logger.info("Adafactor with relative_step: the adafactor scheduler is used; learning_rate only seeds the logged lr")
    return None, f"adafactor:{lr}"


# Optimizer classes whose weight decay is decoupled already, by design (docs/optimizers.md): nothing to switch.
_DECOUPLED_ALREADY = ("AdamW", "Lion", "Adan", "ScheduleFree", "Adafactor")


def decoupled_weight_decay_args(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
    """--decoupled_weight_decay: weight decay applied to the weights, apart from the gradient (Loshchilov & Hutter),
    through the optimizer's own switch: torch's `decoupled_weight_decay` (Adam, ...), `decouple` (Prodigy,
    D-Adaptation). Optimizers that decay that way already (AdamW, Lion, Adan kinds) are left as they are; one
    without either is refused in one line. An explicit value in --optimizer_args wins."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    for switch in ("decoupled_weight_decay", "decouple"):
        if switch in params:
            return {switch: True, **kwargs}
    if any(name in cls.__name__ for name in _DECOUPLED_ALREADY):
        return kwargs
    raise ConfigError(f"--decoupled_weight_decay: {cls.__name__} has no decoupled weight decay switch (it adds "
                      "weight_decay to the gradient); use AdamW, Adam, Prodigy or a D-Adaptation optimizer, or "
                      "leave the switch off")


def _optimizer_kwargs(cls, spec: _Spec, options: OptimizerOptions) -> dict[str, Any]:
    """--optimizer_args, the spec's defaults where the user set none, and --decoupled_weight_decay."""
    kwargs = dict(options.optimizer_args)
    for key, value in spec.defaults:
        kwargs.setdefault(key, value)
    if options.decoupled_weight_decay:
        kwargs = decoupled_weight_decay_args(cls, kwargs)
    return kwargs


def optimizer_class(options: OptimizerOptions):
    """The optimizer class the options name, imported and its --optimizer_args checked; no parameters needed,
    so a missing package or a bad argument is reported before any data or model is loaded."""
    optimizer_type = resolve_optimizer_type(options)
    spec = _spec_for(optimizer_type)
    cls = _import_class(spec.module, spec.cls, optimizer_type, spec.package)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"--optimizer_type {optimizer_type}: {spec.module}.{spec.cls} is not a torch optimizer class")
    _check_kwargs(cls, _optimizer_kwargs(cls, spec, options))
    return cls


def create_optimizer(param_groups, options: OptimizerOptions) -> tuple[torch.optim.Optimizer, str, OptimizerDescriptor]:
    """Build the optimizer named by `options`; returns (optimizer, "module.Class", descriptor).

    `param_groups` is an iterable of parameters or of dicts with "params" (and optionally "lr").
    """
    optimizer_type = resolve_optimizer_type(options)
    spec = _spec_for(optimizer_type)
    cls = optimizer_class(options)

    param_groups = list(param_groups)
    if not param_groups:
        raise ConfigError("create_optimizer: no trainable parameters (check the network / train_* flags)")
    kwargs = _optimizer_kwargs(cls, spec, options)

    lr: Optional[float] = options.learning_rate
    override = None
    if spec.module == "transformers.optimization" and spec.cls == "Adafactor":
        lr, override = _prepare_adafactor(param_groups, options.learning_rate, kwargs)
    if spec.adaptive:
        lrs = _group_lrs(param_groups, options.learning_rate)
        if lrs[0] <= 0.1:
            logger.warning(f"--optimizer_type {optimizer_type}: learning rate {lrs[0]} is low for an adaptive optimizer; "
                           "use about 1.0 (it multiplies the step size the optimizer learns)")
        if len(set(lrs)) > 1:
            logger.warning(f"--optimizer_type {optimizer_type}: only the first group's learning rate takes effect")

    try:
        optimizer = cls(param_groups, lr=lr, **kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--optimizer_args: {spec.cls} rejected {kwargs}: {str(e).splitlines()[0]}") from None
    if override is not None:
        # Adafactor keeps lr=None in its groups; the scheduler reports this until the first step.
        for group in optimizer.param_groups:
            group["initial_lr"] = options.learning_rate
    name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    descriptor = OptimizerDescriptor(
        optimizer_type=optimizer_type,
        name=name,
        kwargs=kwargs,
        ss_optimizer=optimizer_string(optimizer, kwargs),
        adaptive=spec.adaptive,
        schedule_free=is_schedule_free(optimizer),
        lr_scheduler_override=override,
    )
    return optimizer, name, descriptor


def optimizer_string(optimizer, args: dict[str, Any]) -> str:
    """sd-scripts' ss_optimizer value: "module.Class" plus "(k=v,k=v)" when there are arguments."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = f"{cls.__module__}.{cls.__name__}"
    joined = ",".join(f"{k}={v}" for k, v in args.items())
    return f"{name}({joined})" if joined else name


def unwrap_optimizer(optimizer):
    """The optimizer inside wrappers such as accelerate's AcceleratedOptimizer (which has .optimizer)."""
    seen = 0
    while hasattr(optimizer, "optimizer") and seen < 4:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def is_schedule_free(optimizer) -> bool:
    """True for schedule-free optimizers, which must be put in train()/eval() mode by the loop.

    Wrappers are looked through: accelerate's AcceleratedOptimizer has train()/eval() for any optimizer.
    """
    inner = unwrap_optimizer(optimizer)
    return callable(getattr(inner, "train", None)) and callable(getattr(inner, "eval", None))
