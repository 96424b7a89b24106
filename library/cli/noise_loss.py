"""Noise, timestep and loss flags (sd-scripts names and defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Any, Optional

import toml

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


def add_noise_loss_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the --noise_offset ... --debiased_estimation_loss flags."""
    g = parser.add_argument_group("noise and timesteps")
    g.add_argument("--noise_offset", type=float, default=None, help="offset noise strength (about 0.1 is common)")
    g.add_argument("--noise_offset_random_strength", action="store_true",
                   help="draw the offset strength uniformly in [0, noise_offset] per step")
    g.add_argument("--adaptive_noise_scale", type=float, default=None,
                   help="add this times |channel mean of the latents| to the offset (needs --noise_offset)")
    g.add_argument("--multires_noise_iterations", type=int, default=None, help="multires (pyramid) noise levels (6-10)")
    g.add_argument("--multires_noise_discount", type=float, default=0.3, help="weight decay per multires level")
    g.add_argument("--ip_noise_gamma", type=float, default=None, help="input perturbation noise strength (about 0.1)")
    g.add_argument("--ip_noise_gamma_random_strength", action="store_true",
                   help="draw the input perturbation strength uniformly in [0, ip_noise_gamma] per step")
    g.add_argument("--min_timestep", type=int, default=None, help="lowest training timestep (default 0)")
    g.add_argument("--max_timestep", type=int, default=None, help="highest training timestep, exclusive (default 1000)")
    g.add_argument("--zero_terminal_snr", action="store_true",
                   help="rescale the noise schedule to zero terminal SNR (DDPM models)")
    g.add_argument("--rescale_zero_terminal_snr", dest="zero_terminal_snr", action="store_true",
                   help="the same as --zero_terminal_snr (diffusers' name; a --config_file key is zero_terminal_snr)")
    g.add_argument("--timestep_bias_strategy", type=str, default="none", choices=list(BIAS_STRATEGIES),
                   help="draw training timesteps more (or less) often in a region: earlier (the first "
                        "--timestep_bias_portion of 1000), later (the last portion), range (--timestep_bias_begin "
                        "to --timestep_bias_end) or none (default)")
    g.add_argument("--timestep_bias_multiplier", type=float, default=1.0,
                   help="weight of each biased timestep against 1 elsewhere (2: drawn twice as often, 0.5: half as "
                        "often; default 1 = no bias)")
    g.add_argument("--timestep_bias_begin", type=int, default=None,
                   help="first timestep (0-1000, inclusive) of --timestep_bias_strategy range")
    g.add_argument("--timestep_bias_end", type=int, default=None,
                   help="end timestep (0-1000, exclusive) of --timestep_bias_strategy range")
    g.add_argument("--timestep_bias_portion", type=float, default=0.25,
                   help="fraction of the 1000 timesteps that earlier / later biases (default 0.25)")

    g = parser.add_argument_group("noise scheduler (DDPM models: SD 1.x, 2.x, SDXL)")
    g.add_argument("--prediction_type", type=str, default=None, choices=list(PREDICTION_TYPES),
                   help="what the model predicts: epsilon or v_prediction (v_prediction is --v_parameterization; "
                        "default: --v_parameterization's setting)")
    g.add_argument("--timestep_spacing", type=str, default=None, choices=list(TIMESTEP_SPACINGS),
                   help="how sample images space their denoising steps (leading, trailing, linspace; default: each "
                        "sampler's own). Training draws every integer timestep, so it changes sampling only")
    g.add_argument("--noise_scheduler_overrides", type=str, default=None,
                   help="TOML file of noise-scheduler settings (num_train_timesteps, beta_start, beta_end, "
                        "beta_schedule, rescale_betas_zero_snr, timestep_spacing, prediction_type) replacing SD's")

    g = parser.add_argument_group("loss")
    g.add_argument("--loss_type", type=str, default="l2", choices=list(LOSS_TYPES), help="elementwise loss: l2 (default), l1, huber, smooth_l1")
    g.add_argument("--huber_schedule", type=str, default="snr", choices=list(HUBER_SCHEDULES),
                   help="how the huber/smooth_l1 threshold c changes with the timestep")
    g.add_argument("--huber_c", type=float, default=0.1, help="huber/smooth_l1 threshold (base value of the schedule)")
    g.add_argument("--huber_scale", type=float, default=1.0, help="multiplies c in the exponential and constant schedules")
    g.add_argument("--min_snr_gamma", type=float, default=None, help="min-SNR weighting gamma (5 is common)")
    g.add_argument("--soft_min_snr_gamma", type=float, default=None,
                   help="soft min-SNR weighting gamma instead of --min_snr_gamma: weight gamma/(SNR+gamma) "
                        "(v-prediction: SNR*gamma/((SNR+gamma)(SNR+1)))")
    g.add_argument("--scale_v_pred_loss_like_noise_pred", action="store_true",
                   help="v-prediction only: scale the loss like an epsilon-prediction loss")
    g.add_argument("--v_pred_like_loss", type=float, default=None,
                   help="epsilon-prediction only: add this times a v-prediction-like loss")
    g.add_argument("--debiased_estimation_loss", action="store_true", help="weight the loss by 1/sqrt(SNR)")


def _positive(flag: str, value, integer: bool = False) -> None:
    if value is not None and not value > 0:
        kind = "an integer >= 1" if integer else "a number > 0"
        raise ConfigError(f"{flag}: expected {kind}, got {value}")


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
        if spacing not in TIMESTEP_SPACINGS:
            raise ConfigError(f"--timestep_spacing: expected one of {', '.join(TIMESTEP_SPACINGS)}, got {spacing!r}")
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
    strategy = getattr(ns, "timestep_bias_strategy", None) or "none"
    bias = TimestepBias(strategy=strategy, multiplier=getattr(ns, "timestep_bias_multiplier", 1.0),
                        begin=getattr(ns, "timestep_bias_begin", None), end=getattr(ns, "timestep_bias_end", None),
                        portion=getattr(ns, "timestep_bias_portion", 0.25))
    if strategy == "none":
        for flag, value, default in (("--timestep_bias_multiplier", bias.multiplier, 1.0),
                                     ("--timestep_bias_begin", bias.begin, None),
                                     ("--timestep_bias_end", bias.end, None),
                                     ("--timestep_bias_portion", bias.portion, 0.25)):
            if value != default:
                raise ConfigError(f"{flag}: needs --timestep_bias_strategy earlier, later or range")
        return None
    bias.check(num_train_timesteps)
    return bias


def noise_options_from_args(ns: argparse.Namespace) -> NoiseOptions:
    """NoiseOptions from the parsed flags; impossible combinations raise ConfigError."""
    schedule = noise_schedule_from_args(ns)
    max_timestep = schedule.num_train_timesteps if schedule is not None else MAX_TIMESTEP
    if ns.adaptive_noise_scale is not None and ns.noise_offset is None:
        raise ConfigError("--adaptive_noise_scale: needs --noise_offset")
    if ns.noise_offset_random_strength and ns.noise_offset is None:
        raise ConfigError("--noise_offset_random_strength: needs --noise_offset")
    if ns.ip_noise_gamma_random_strength and ns.ip_noise_gamma is None:
        raise ConfigError("--ip_noise_gamma_random_strength: needs --ip_noise_gamma")
    _positive("--multires_noise_iterations", ns.multires_noise_iterations, integer=True)
    if ns.multires_noise_discount is not None and not 0 < ns.multires_noise_discount <= 1:
        raise ConfigError(f"--multires_noise_discount: expected a number in (0, 1], got {ns.multires_noise_discount}")
    for flag, value in (("--noise_offset", ns.noise_offset), ("--ip_noise_gamma", ns.ip_noise_gamma)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag}: expected a number >= 0, got {value}")
    lo, hi = ns.min_timestep, ns.max_timestep
    for flag, value in (("--min_timestep", lo), ("--max_timestep", hi)):
        if value is not None and not 0 <= value <= max_timestep:
            raise ConfigError(f"{flag}: expected an integer from 0 to {max_timestep}, got {value}")
    if (lo or 0) > (max_timestep if hi is None else hi):
        raise ConfigError(f"--min_timestep ({lo or 0}) is above --max_timestep ({max_timestep if hi is None else hi})")
    return NoiseOptions(
        noise_offset=ns.noise_offset,
        noise_offset_random_strength=bool(ns.noise_offset_random_strength),
        adaptive_noise_scale=ns.adaptive_noise_scale,
        multires_noise_iterations=ns.multires_noise_iterations,
        multires_noise_discount=ns.multires_noise_discount if ns.multires_noise_discount is not None else 0.3,
        ip_noise_gamma=ns.ip_noise_gamma,
        ip_noise_gamma_random_strength=bool(ns.ip_noise_gamma_random_strength),
        min_timestep=lo,
        max_timestep=hi,
        timestep_bias=timestep_bias_from_args(ns, max_timestep),
    )


def loss_options_from_args(ns: argparse.Namespace) -> LossOptions:
    """LossOptions from the parsed flags (checks that need the model run later in check_loss_options)."""
    if ns.loss_type not in LOSS_TYPES:
        raise ConfigError(f"--loss_type: expected one of {', '.join(LOSS_TYPES)}, got {ns.loss_type!r}")
    if ns.huber_schedule not in HUBER_SCHEDULES:
        raise ConfigError(f"--huber_schedule: expected one of {', '.join(HUBER_SCHEDULES)}, got {ns.huber_schedule!r}")
    _positive("--huber_c", ns.huber_c)
    _positive("--huber_scale", ns.huber_scale)
    _positive("--min_snr_gamma", ns.min_snr_gamma)
    _positive("--soft_min_snr_gamma", getattr(ns, "soft_min_snr_gamma", None))
    if ns.min_snr_gamma is not None and getattr(ns, "soft_min_snr_gamma", None) is not None:
        raise ConfigError("--soft_min_snr_gamma: replaces --min_snr_gamma; set only one of them")
    _positive("--v_pred_like_loss", ns.v_pred_like_loss)
    return LossOptions(
        loss_type=ns.loss_type,
        huber_schedule=ns.huber_schedule,
        huber_c=ns.huber_c,
        huber_scale=ns.huber_scale,
        min_snr_gamma=ns.min_snr_gamma,
        soft_min_snr_gamma=getattr(ns, "soft_min_snr_gamma", None),
        scale_v_pred_loss_like_noise_pred=bool(ns.scale_v_pred_loss_like_noise_pred),
        v_pred_like_loss=ns.v_pred_like_loss,
        debiased_estimation_loss=bool(ns.debiased_estimation_loss),
        masked_loss=bool(getattr(ns, "masked_loss", False)),
    )
