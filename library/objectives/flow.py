"""Rectified-flow (flow matching) training scheme, as FLUX.1 is trained.

The forward process is a straight line between data and noise:

    x_σ = (1 - σ) x0 + σ ε,      σ in [0, 1],      target v = ε - x0

Timesteps travel through the loop as `σ * 1000` (float), the unit the model
call and the loss schedules share with the DDPM families; `add_noise` and
`target` divide by 1000 again. Every random draw uses the generator passed in,
so a resumed run replays the same σ.

`--model_prediction_type` says how the raw model output becomes the prediction
compared with the target:

- raw (our default): the output itself is the velocity estimate.
- additive: output + x_σ.
- sigma_scaled (sd-scripts' default): x_σ - σ · output, which is an estimate of
  x0, compared against the velocity target ε - x0; the loss is then weighted by
  `--weighting_scheme` (sigma_sqrt / cosmap). We keep it for compatibility.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from library.core.errors import ConfigError
from library.objectives.noise import rand, randn
from library.objectives.timestep_bias import TimestepBias, biased_continuous_timesteps

TIMESTEP_SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
WEIGHTING_SCHEMES = ("uniform", "none", "logit_normal", "mode", "cosmap", "sigma_sqrt")
PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
NUM_TRAIN_TIMESTEPS = 1000
# flux_shift: μ grows linearly with the image token count, from 0.5 at 256 tokens to 1.15 at 4096.
FLUX_SHIFT_POINTS = ((256, 0.5), (4096, 1.15))


@dataclass
class FlowOptions:
    """The flow-matching flags (declared here, turned into flags by library/cli/options.py); defaults as
    sd-scripts except the prediction type."""
    timestep_sampling: str = field(default="sigma", metadata={
        "choices": TIMESTEP_SAMPLINGS,
        "help": "how σ is drawn: sigma (by --weighting_scheme, on the shifted schedule), uniform, sigmoid, "
                "shift (sigmoid then --discrete_flow_shift) or flux_shift (shifted by image size)"})
    sigmoid_scale: float = field(default=1.0, metadata={
        "help": "scale of the normal draw inside sigmoid/shift/flux_shift sampling"})
    discrete_flow_shift: float = field(default=3.0, metadata={
        "help": "shift of the schedule for --timestep_sampling sigma and shift (> 1: noisier)"})
    weighting_scheme: str = field(default="uniform", metadata={
        "choices": WEIGHTING_SCHEMES,
        "help": "density of σ for --timestep_sampling sigma; loss weight under sigma_scaled"})
    logit_mean: float = field(default=0.0, metadata={"help": "mean of the logit_normal weighting scheme"})
    logit_std: float = field(default=1.0, metadata={"help": "std of the logit_normal weighting scheme"})
    mode_scale: float = field(default=1.29, metadata={"help": "scale of the mode weighting scheme"})
    model_prediction_type: str = field(default="raw", metadata={
        "choices": PREDICTION_TYPES,
        "help": "raw (default here: the output is the velocity), additive (output + x_t) or sigma_scaled "
                "(sd-scripts' default: an x0 estimate compared with the velocity target)"})

    def check(self) -> None:
        """ConfigError naming the flag when a value is outside what the scheme accepts."""
        for flag, value, allowed in (("--timestep_sampling", self.timestep_sampling, TIMESTEP_SAMPLINGS),
                                     ("--weighting_scheme", self.weighting_scheme, WEIGHTING_SCHEMES),
                                     ("--model_prediction_type", self.model_prediction_type, PREDICTION_TYPES)):
            if value not in allowed:
                raise ConfigError(f"{flag}: expected one of {', '.join(allowed)}, got {value!r}")
        for flag, value in (("--sigmoid_scale", self.sigmoid_scale), ("--discrete_flow_shift", self.discrete_flow_shift),
                            ("--logit_std", self.logit_std)):
            if not value > 0:
                raise ConfigError(f"{flag}: expected a number > 0, got {value}")


def check_flow_compatible(min_timestep: Optional[int], max_timestep: Optional[int], zero_terminal_snr: bool) -> None:
    """Refuse the DDPM-only flags for a flow-matching model (one-line ConfigError naming the flag)."""
    for flag, value in (("min_timestep", min_timestep), ("max_timestep", max_timestep)):
        if value is not None:
            raise ConfigError(f"--{flag}: not supported for flow-matching models (FLUX.1); "
                              "shape the σ distribution with --timestep_sampling instead")
    if zero_terminal_snr:
        raise ConfigError("--zero_terminal_snr: only for DDPM models; a flow-matching model already reaches pure noise")


def check_no_ddpm_schedule(v_parameterization: bool, noise_schedule, model_name: str, schedule_flags: str) -> None:
    """Refuse the DDPM prediction and schedule flags for a flow model called `model_name`, whose schedule
    `schedule_flags` set instead (one-line ConfigError naming the flag)."""
    if v_parameterization:
        raise ConfigError(f"--v_parameterization: only for DDPM models; {model_name} predicts a velocity, so "
                          f"neither --v_parameterization / --prediction_type v_prediction applies")
    if noise_schedule is not None:
        raise ConfigError(f"--noise_scheduler_overrides / --timestep_spacing: only for DDPM models; {model_name}'s "
                          f"schedule is set by {schedule_flags}")


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """σ' = shift·σ / (1 + (shift - 1)·σ): a shift > 1 moves training towards noisier σ."""
    return sigmas * shift / (1 + (shift - 1) * sigmas)


def flux_shift_mu(image_tokens: int) -> float:
    """μ of flux_shift for an image of `image_tokens` 2x2 latent patches (linear through FLUX_SHIFT_POINTS)."""
    (x1, y1), (x2, y2) = FLUX_SHIFT_POINTS
    slope = (y2 - y1) / (x2 - x1)
    return slope * image_tokens + (y1 - slope * x1)


def time_shift(mu: float, sigmas: torch.Tensor) -> torch.Tensor:
    """σ' = e^μ / (e^μ + 1/σ - 1): the resolution-dependent shift of FLUX.1-dev's sampler."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


def density_samples(scheme: str, batch_size: int, generator: Optional[torch.Generator], *, logit_mean: float = 0.0,
                    logit_std: float = 1.0, mode_scale: float = 1.29) -> torch.Tensor:
    """u in [0, 1) per sample, drawn with the density of the weighting scheme (SD3 paper, section 3.1)."""
    if scheme == "logit_normal":
        return torch.sigmoid(randn((batch_size,), generator, "cpu") * logit_std + logit_mean)
    u = rand((batch_size,), generator, "cpu")
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weight of a weighting scheme: sigma_sqrt σ^-2, cosmap 2/(π(1-2σ+2σ²)), else 1."""
    sigmas = sigmas.float()
    if scheme == "sigma_sqrt":
        return sigmas ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return torch.ones_like(sigmas)


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(like.device, like.dtype).reshape(values.shape[0], *([1] * (like.ndim - 1)))


class FlowMatchScheme:
    """Rectified flow with sd-scripts' FLUX.1 timestep samplers, weighting and prediction types."""
    has_snr = False  # min-SNR, debiased and v-pred loss terms do not apply
    prediction_type = "flow"
    num_train_timesteps = NUM_TRAIN_TIMESTEPS
    # σ = 0.2, 0.4, 0.6, 0.8: the same fixed points as the DDPM validation, read as flow times.
    validation_timesteps = (200, 400, 600, 800)

    def __init__(self, options: Optional[FlowOptions] = None):
        self.options = options or FlowOptions()
        self.options.check()

    # --- timesteps ----------------------------------------------------------------
    def sample_sigmas(self, batch_size: int, generator: Optional[torch.Generator] = None,
                      latent_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """σ per sample (B,) float32 on the CPU, by --timestep_sampling."""
        o = self.options
        mode = o.timestep_sampling
        if mode == "uniform":
            return rand((batch_size,), generator, "cpu")
        if mode in ("sigmoid", "shift", "flux_shift"):
            sigmas = torch.sigmoid(o.sigmoid_scale * randn((batch_size,), generator, "cpu"))
            if mode == "shift":
                return shift_sigmas(sigmas, o.discrete_flow_shift)
            if mode == "flux_shift":
                if latent_shape is None:
                    raise ValueError("flux_shift needs the latent shape to count image tokens")
                h, w = latent_shape[-2:]
                return time_shift(flux_shift_mu((h // 2) * (w // 2)), sigmas)
            return sigmas
        # "sigma": u by the weighting scheme's density, looked up in the shifted 1000-step Euler schedule.
        u = density_samples(o.weighting_scheme, batch_size, generator, logit_mean=o.logit_mean,
                            logit_std=o.logit_std, mode_scale=o.mode_scale)
        index = (u * NUM_TRAIN_TIMESTEPS).long().clamp(0, NUM_TRAIN_TIMESTEPS - 1)
        return self.schedule_sigmas()[index]

    def schedule_sigmas(self) -> torch.Tensor:
        """The 1000 σ of FlowMatchEulerDiscreteScheduler(shift=--discrete_flow_shift), from 1 down to 0.001."""
        steps = torch.linspace(NUM_TRAIN_TIMESTEPS, 1, NUM_TRAIN_TIMESTEPS, dtype=torch.float32)
        return shift_sigmas(steps / NUM_TRAIN_TIMESTEPS, self.options.discrete_flow_shift)

    def sample_timesteps(self, batch_size: int, min_timestep: Optional[int] = None,
                         max_timestep: Optional[int] = None, generator: Optional[torch.Generator] = None,
                         device="cpu", latent_shape: Optional[Sequence[int]] = None,
                         bias: Optional[TimestepBias] = None) -> torch.Tensor:
        """Timesteps σ·1000 (B,) float32. --min_timestep/--max_timestep are refused when the flags are read (check_flow_compatible).

        An active `bias` reweights the sampler's density by its weights on σ·1000 (acceptance-rejection).
        """
        def propose(k: int) -> torch.Tensor:
            return self.sample_sigmas(k, generator, latent_shape) * NUM_TRAIN_TIMESTEPS

        if bias is not None and bias.active:
            return biased_continuous_timesteps(bias, batch_size, propose, NUM_TRAIN_TIMESTEPS, generator).to(device)
        return propose(batch_size).to(device)

    @staticmethod
    def sigma_of(timesteps: torch.Tensor) -> torch.Tensor:
        """σ (B,) float32 of timesteps in the loop's unit (σ·1000)."""
        return timesteps.float() / NUM_TRAIN_TIMESTEPS

    # --- forward process --------------------------------------------------------------
    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_σ = (1 - σ)·x0 + σ·ε."""
        s = per_sample(self.sigma_of(timesteps), latents)
        return (1 - s) * latents + s * noise

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The velocity ε - x0 (the same for every prediction type, as sd-scripts)."""
        return noise - latents

    def prediction(self, model_output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What is compared with the target, by --model_prediction_type."""
        kind = self.options.model_prediction_type
        if kind == "raw":
            return model_output
        if kind == "additive":
            return model_output + noisy.to(model_output.dtype)
        s = per_sample(self.sigma_of(timesteps), model_output)
        return noisy.to(model_output.dtype) - s * model_output

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Per-sample loss weight (B,): the weighting scheme under sigma_scaled (as sd-scripts), else 1."""
        sigmas = self.sigma_of(timesteps)
        if self.options.model_prediction_type != "sigma_scaled":
            return torch.ones_like(sigmas)
        return loss_weighting(self.options.weighting_scheme, sigmas)

    # --- for the huber "snr" schedule ----------------------------------------------------
    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Noise-to-signal ratio σ / (1 - σ) (B,): the flow counterpart of DDPM's sqrt((1-ᾱ)/ᾱ)."""
        s = self.sigma_of(timesteps)
        return s / (1 - s)
