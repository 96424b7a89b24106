"""Noise, timestep and loss flags (sd-scripts names and defaults)."""

from __future__ import annotations

import argparse

from library.core.errors import ConfigError
from library.objectives.losses import HUBER_SCHEDULES, LOSS_TYPES, LossOptions
from library.objectives.noise import NoiseOptions

MAX_TIMESTEP = 1000  # the SD / SDXL / Flux trainers all count 1000 training timesteps


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
    g.add_argument("--zero_terminal_snr", action="store_true", help="rescale the noise schedule to zero terminal SNR")

    g = parser.add_argument_group("loss")
    g.add_argument("--loss_type", type=str, default="l2", choices=list(LOSS_TYPES), help="elementwise loss: l2 (default), l1, huber, smooth_l1")
    g.add_argument("--huber_schedule", type=str, default="snr", choices=list(HUBER_SCHEDULES),
                   help="how the huber/smooth_l1 threshold c changes with the timestep")
    g.add_argument("--huber_c", type=float, default=0.1, help="huber/smooth_l1 threshold (base value of the schedule)")
    g.add_argument("--huber_scale", type=float, default=1.0, help="multiplies c in the exponential and constant schedules")
    g.add_argument("--min_snr_gamma", type=float, default=None, help="min-SNR weighting gamma (5 is common)")
    g.add_argument("--scale_v_pred_loss_like_noise_pred", action="store_true",
                   help="v-prediction only: scale the loss like an epsilon-prediction loss")
    g.add_argument("--v_pred_like_loss", type=float, default=None,
                   help="epsilon-prediction only: add this times a v-prediction-like loss")
    g.add_argument("--debiased_estimation_loss", action="store_true", help="weight the loss by 1/sqrt(SNR)")


def _positive(flag: str, value, integer: bool = False) -> None:
    if value is not None and not value > 0:
        kind = "an integer >= 1" if integer else "a number > 0"
        raise ConfigError(f"{flag}: expected {kind}, got {value}")


def noise_options_from_args(ns: argparse.Namespace) -> NoiseOptions:
    """NoiseOptions from the parsed flags; impossible combinations raise ConfigError."""
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
        if value is not None and not 0 <= value <= MAX_TIMESTEP:
            raise ConfigError(f"{flag}: expected an integer from 0 to {MAX_TIMESTEP}, got {value}")
    if (lo or 0) > (MAX_TIMESTEP if hi is None else hi):
        raise ConfigError(f"--min_timestep ({lo or 0}) is above --max_timestep ({MAX_TIMESTEP if hi is None else hi})")
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
    _positive("--v_pred_like_loss", ns.v_pred_like_loss)
    return LossOptions(
        loss_type=ns.loss_type,
        huber_schedule=ns.huber_schedule,
        huber_c=ns.huber_c,
        huber_scale=ns.huber_scale,
        min_snr_gamma=ns.min_snr_gamma,
        scale_v_pred_loss_like_noise_pred=bool(ns.scale_v_pred_loss_like_noise_pred),
        v_pred_like_loss=ns.v_pred_like_loss,
        debiased_estimation_loss=bool(ns.debiased_estimation_loss),
        masked_loss=bool(getattr(ns, "masked_loss", False)),
    )
