"""Noise, timestep and loss flags (sd-scripts names and defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional

import toml

from library.cli.options import Range, add_flags, at_least, flag, flag_specs, settings_from
from library.core.errors import ConfigError
from library.objectives.losses import HUBER_SCHEDULES, LOSS_TYPES, LossOptions
from library.objectives.noise import PREDICTION_TYPES, TIMESTEP_SPACINGS, DDPMSchedule, NoiseOptions
from library.objectives.timestep_bias import BIAS_STRATEGIES, TimestepBias

MAX_TIMESTEP = 1000  # the SD / SDXL / Flux trainers all count 1000 training timesteps (unless overridden)

# --noise_scheduler_overrides keys (diffusers' scheduler_config names) -> DDPMSchedule fields, with their types.
SCHEDULER_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "num_train_timesteps": ("num_train_timesteps", (int,)),
    "beta_start": ("beta_start", (float, int)),
    "beta_end": ("beta_end", (float, int)),
    "beta_schedule": ("beta_schedule", (str,)),
    "rescale_betas_zero_snr": ("zero_terminal_snr", (bool,)),
    "timestep_spacing": ("timestep_spacing", (str,)),
    "prediction_type": ("", (str,)),  # folded into --v_parameterization / --prediction_type
}


@dataclass
class NoiseFlags:
    flag_group: ClassVar[str] = "noise and timesteps"
    noise_offset: Optional[float] = flag(None, "offset noise strength (about 0.1 is common)", range=Range(lo=0))
    noise_offset_random_strength: bool = flag(False, "draw the offset strength uniformly in [0, noise_offset] per "
                                                     "step")
    adaptive_noise_scale: Optional[float] = flag(None, "add this times |channel mean of the latents| to the offset "
                                                       "(needs --noise_offset)", range=Range())
    multires_noise_iterations: Optional[int] = flag(None, "multires (pyramid) noise levels (6-10)", range=at_least(1))
    multires_noise_discount: float = flag(0.3, "weight decay per multires level", range=Range(0, 1, lo_open=True))
    ip_noise_gamma: Optional[float] = flag(None, "input perturbation noise strength (about 0.1)", range=Range(lo=0))
    ip_noise_gamma_random_strength: bool = flag(False, "draw the input perturbation strength uniformly in [0, "
                                                       "ip_noise_gamma] per step")
    min_timestep: Optional[int] = flag(None, "lowest training timestep (default 0)",
                                             range=Range(0, 1000, integer=True))
    max_timestep: Optional[int] = flag(None, "highest training timestep, exclusive (default 1000)",
                                             range=Range(0, 1000, integer=True))
    zero_terminal_snr: bool = flag(False, "rescale the noise schedule to zero terminal SNR (DDPM models); "
                                          "--rescale_zero_terminal_snr is the same (diffusers' name)",
                                   aliases=("rescale_zero_terminal_snr",))
    timestep_bias_strategy: str = flag("none", "draw training timesteps more (or less) often in a region: earlier "
                                               "(the first --timestep_bias_portion of 1000), later (the last "
                                               "portion), range (--timestep_bias_begin to --timestep_bias_end) or "
                                               "none (default)", choices=BIAS_STRATEGIES)
    timestep_bias_multiplier: float = flag(1.0, "weight of each biased timestep against 1 elsewhere (2: drawn twice "
                                                "as often, 0.5: half as often; default 1 = no bias)",
                                                range=Range(lo=0, lo_open=True))
    timestep_bias_begin: Optional[int] = flag(None, "first timestep (0-1000, inclusive) of --timestep_bias_strategy "
                                                    "range", range=Range(0, 1000, integer=True))
    timestep_bias_end: Optional[int] = flag(None, "end timestep (0-1000, exclusive) of --timestep_bias_strategy range",
                                                  range=Range(0, 1000, integer=True))
    timestep_bias_portion: float = flag(0.25, "fraction of the 1000 timesteps that earlier / later biases (default "
                                              "0.25)", range=Range(0, 1, lo_open=True))


@dataclass
class NoiseSchedulerFlags:
    flag_group: ClassVar[str] = "noise scheduler (DDPM models: SD 1.x, 2.x, SDXL)"
    prediction_type: Optional[str] = flag(None, "what the model predicts: epsilon or v_prediction (v_prediction is "
                                                "--v_parameterization; default: --v_parameterization's setting)",
                                                choices=PREDICTION_TYPES)
    timestep_spacing: Optional[str] = flag(None, "how sample images space their denoising steps (leading, trailing, "
                                                 "linspace; default: each sampler's own). Training draws every "
                                                 "integer timestep, so it changes sampling only",
                                                 choices=TIMESTEP_SPACINGS)
    noise_scheduler_overrides: Optional[str] = flag(None, "TOML file of noise-scheduler settings "
                                                          "(num_train_timesteps, beta_start, beta_end, beta_schedule,"
                                                          " rescale_betas_zero_snr, timestep_spacing, "
                                                          "prediction_type) replacing SD's")


@dataclass
class LossFlags:
    flag_group: ClassVar[str] = "loss"
    loss_type: str = flag("l2", "elementwise loss: l2 (default), l1, huber, smooth_l1",
                                choices=LOSS_TYPES)
    huber_schedule: str = flag("snr", "how the huber/smooth_l1 threshold c changes with the timestep",
                                      choices=HUBER_SCHEDULES)
    huber_c: float = flag(0.1, "huber/smooth_l1 threshold (base value of the schedule)",
                          range=Range(lo=0, lo_open=True))
    huber_scale: float = flag(1.0, "multiplies c in the exponential and constant schedules",
                                   range=Range(lo=0, lo_open=True))
    min_snr_gamma: Optional[float] = flag(None, "min-SNR weighting gamma (5 is common)",
                                          range=Range(lo=0, lo_open=True))
    soft_min_snr_gamma: Optional[float] = flag(None, "soft min-SNR weighting gamma instead of --min_snr_gamma: weight"
                                                     " gamma/(SNR+gamma) (v-prediction: "
                                                     "SNR*gamma/((SNR+gamma)(SNR+1)))", range=Range(lo=0, lo_open=True))
    scale_v_pred_loss_like_noise_pred: bool = flag(False, "v-prediction only: scale the loss like an "
                                                          "epsilon-prediction loss")
    v_pred_like_loss: Optional[float] = flag(None, "epsilon-prediction only: add this times a v-prediction-like loss",
                                                   range=Range(lo=0, lo_open=True))
    debiased_estimation_loss: bool = flag(False, "weight the loss by 1/sqrt(SNR)")


def add_noise_loss_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the --noise_offset ... --debiased_estimation_loss flags."""
    add_flags(parser, flag_specs(NoiseFlags) + flag_specs(NoiseSchedulerFlags) + flag_specs(LossFlags))


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def read_scheduler_overrides(path: str) -> dict[str, Any]:
    """The --noise_scheduler_overrides table: top-level keys, or a single [noise_scheduler] table; keys and
    value types checked one by one (ConfigError naming the key)."""
    flag = "--noise_scheduler_overrides"
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: {path} does not exist")
    try:
        data = toml.load(path)
    except (toml.TomlDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag}: {path} is not valid TOML: {str(e).splitlines()[0]}") from None
    if set(data) == {"noise_scheduler"} and isinstance(data["noise_scheduler"], dict):
        data = data["noise_scheduler"]
    for key, value in data.items():
        if key not in SCHEDULER_KEYS:
            raise ConfigError(f"{flag}: unknown key {key!r} in {path}; expected {', '.join(SCHEDULER_KEYS)}")
        types = SCHEDULER_KEYS[key][1]
        if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
            raise ConfigError(f"{flag}: {key} = {value!r} in {path}: expected "
                              f"{' or '.join(_TYPE_NAMES[t] for t in types)}")
    return data


def _overrides(ns: argparse.Namespace) -> dict[str, Any]:
    path = getattr(ns, "noise_scheduler_overrides", None)
    return read_scheduler_overrides(path) if path else {}


def prediction_type_from_args(ns: argparse.Namespace) -> Optional[str]:
    """The one prediction setting of --v_parameterization, --prediction_type and the overrides file's
    prediction_type: None when none is given; conflicting values raise ConfigError."""
    given = []
    if getattr(ns, "v_parameterization", False):
        given.append(("--v_parameterization", "v_prediction"))
    if getattr(ns, "prediction_type", None) is not None:
        given.append(("--prediction_type", ns.prediction_type))
    file_value = _overrides(ns).get("prediction_type")
    if file_value is not None:
        if file_value not in PREDICTION_TYPES:
            raise ConfigError(f"--noise_scheduler_overrides: prediction_type = {file_value!r}: expected one of "
                              f"{', '.join(PREDICTION_TYPES)}")
        given.append(("prediction_type in --noise_scheduler_overrides", file_value))
    for (flag_a, a), (flag_b, b) in zip(given, given[1:]):
        if a != b:
            raise ConfigError(f"{flag_b} {b} conflicts with {flag_a} ({a}); v_prediction is --v_parameterization")
    return given[0][1] if given else None


def noise_schedule_from_args(ns: argparse.Namespace) -> Optional[DDPMSchedule]:
    """The DDPM schedule overrides (--noise_scheduler_overrides, --timestep_spacing), checked; None when neither is
    given (the family's own schedule). --zero_terminal_snr stays its own flag."""
    values = {SCHEDULER_KEYS[k][0]: v for k, v in _overrides(ns).items() if SCHEDULER_KEYS[k][0]}
    spacing = getattr(ns, "timestep_spacing", None)
    if spacing is not None:
        if values.get("timestep_spacing", spacing) != spacing:
            raise ConfigError(f"--timestep_spacing {spacing} conflicts with timestep_spacing = "
                              f"{values['timestep_spacing']!r} in --noise_scheduler_overrides")
        values["timestep_spacing"] = spacing
    if not values:
        return None
    known = {f.name for f in fields(DDPMSchedule)}
    schedule = DDPMSchedule(**{k: v for k, v in values.items() if k in known})
    try:
        schedule.check()
    except ConfigError as e:
        raise ConfigError(f"--noise_scheduler_overrides: {e}") from None
    return schedule


def timestep_bias_from_args(ns: argparse.Namespace, num_train_timesteps: int = MAX_TIMESTEP) -> Optional[TimestepBias]:
    """The --timestep_bias_* flags, checked; None for strategy none (the samplers draw as without the flags)."""
    strategy = ns.timestep_bias_strategy or "none"
    bias = TimestepBias(strategy=strategy, multiplier=ns.timestep_bias_multiplier, begin=ns.timestep_bias_begin,
                        end=ns.timestep_bias_end, portion=ns.timestep_bias_portion)
    if strategy == "none":
        for name, default in _BIAS_DEFAULTS.items():
            if getattr(bias, name) != default:
                raise ConfigError(f"--timestep_bias_{name}: needs --timestep_bias_strategy earlier, later or range")
        return None
    bias.check(num_train_timesteps)
    return bias


# The declared defaults of --timestep_bias_multiplier, _begin, _end and _portion (by TimestepBias field).
_BIAS_DEFAULTS = {spec.name[len("timestep_bias_"):]: spec.default for spec in flag_specs(NoiseFlags)
                  if spec.name.startswith("timestep_bias_") and spec.name != "timestep_bias_strategy"}


def noise_options_from_args(ns: argparse.Namespace) -> NoiseOptions:
    """NoiseOptions; the checks are those of flag combinations (each flag's own range is declared)."""
    schedule = noise_schedule_from_args(ns)
    max_timestep = schedule.num_train_timesteps if schedule is not None else MAX_TIMESTEP
    if ns.adaptive_noise_scale is not None and ns.noise_offset is None:
        raise ConfigError("--adaptive_noise_scale: needs --noise_offset")
    if ns.noise_offset_random_strength and ns.noise_offset is None:
        raise ConfigError("--noise_offset_random_strength: needs --noise_offset")
    if ns.ip_noise_gamma_random_strength and ns.ip_noise_gamma is None:
        raise ConfigError("--ip_noise_gamma_random_strength: needs --ip_noise_gamma")
    lo, hi = ns.min_timestep, ns.max_timestep
    for name, value in (("--min_timestep", lo), ("--max_timestep", hi)):  # the schedule may count fewer than 1000
        if value is not None and not 0 <= value <= max_timestep:
            raise ConfigError(f"{name}: expected an integer from 0 to {max_timestep}, got {value}")
    if (lo or 0) > (max_timestep if hi is None else hi):
        raise ConfigError(f"--min_timestep ({lo or 0}) is above --max_timestep ({max_timestep if hi is None else hi})")
    return settings_from(NoiseOptions, ns, timestep_bias=timestep_bias_from_args(ns, max_timestep))


def loss_options_from_args(ns: argparse.Namespace) -> LossOptions:
    """LossOptions (checks that need the model run later in check_loss_options)."""
    if ns.min_snr_gamma is not None and ns.soft_min_snr_gamma is not None:
        raise ConfigError("--soft_min_snr_gamma: replaces --min_snr_gamma; set only one of them")
    return settings_from(LossOptions, ns)  # masked_loss: a dataset flag, absent from a parser of these flags only
