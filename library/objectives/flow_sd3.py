"""SD3 / SD3.5's flow-matching training scheme, as sd-scripts' sd3_train_network.py trains it.

Not FLUX.1's scheme (library/objectives/flow.py) although the forward process is the same
straight line x_t = (1 - σ)·x0 + σ·ε:

- u in [0, 1) is drawn with the density of --weighting_scheme (logit_normal, mode, else
  uniform), shifted by --training_shift (u' = s·u / (1 + (s - 1)·u)), and made an integer
  timestep t = floor(u'·(max - min) + min) with --min_timestep / --max_timestep (default 0
  and 1000); σ = t / 1000.
- The model's output v becomes an x0 estimate x_t - σ·v, compared with x0 (the latents);
  the loss is weighted by sigma_sqrt (σ^-2) or cosmap, else 1.

One difference from sd-scripts, a trap there: t = 0 (σ = 0) is drawn about once per 1000
samples, and under sigma_sqrt its weight is infinite (0 · inf = NaN loss); here t is at
least 1 whatever --min_timestep says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from library.core.errors import ConfigError
from library.objectives.flow import (
    NUM_TRAIN_TIMESTEPS,
    per_sample,
    density_samples,
    loss_weighting,
)

SD3_WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")


@dataclass
class SD3FlowOptions:
    """sd-scripts' SD3 timestep flags (add_dit_training_arguments and --training_shift), same defaults."""
    weighting_scheme: str = field(default="uniform", metadata={
        "choices": SD3_WEIGHTING_SCHEMES,
        "help": "timestep density (logit_normal, mode; else uniform) and loss weight (sigma_sqrt, cosmap; else 1); "
                "uniform and none are the same"})
    logit_mean: float = field(default=0.0, metadata={"help": "mean of the logit_normal weighting scheme"})
    logit_std: float = field(default=1.0, metadata={"help": "std of the logit_normal weighting scheme"})
    mode_scale: float = field(default=1.29, metadata={"help": "scale of the mode weighting scheme"})
    training_shift: float = field(default=1.0, metadata={
        "help": "shift of the drawn timesteps, u' = s·u / (1 + (s - 1)·u); > 1: noisier (sd-scripts' default 1.0)"})

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        if self.weighting_scheme not in SD3_WEIGHTING_SCHEMES:
            raise ConfigError(f"--weighting_scheme: expected one of {', '.join(SD3_WEIGHTING_SCHEMES)}, "
                              f"got {self.weighting_scheme!r}")
        for flag, value in (("--logit_std", self.logit_std), ("--training_shift", self.training_shift)):
            if not value > 0:
                raise ConfigError(f"{flag}: expected a number > 0, got {value}")


class SD3FlowScheme:
    """Rectified flow with SD3's timestep draw, x0 preconditioning and loss weighting (see module docstring)."""
    has_snr = False
    prediction_type = "flow"
    num_train_timesteps = NUM_TRAIN_TIMESTEPS
    validation_timesteps = (200, 400, 600, 800)

    def __init__(self, options: Optional[SD3FlowOptions] = None):
        self.options = options or SD3FlowOptions()
        self.options.check()

    def sample_timesteps(self, batch_size: int, min_timestep: Optional[int] = None,
                         max_timestep: Optional[int] = None, generator: Optional[torch.Generator] = None,
                         device="cpu", latent_shape: Optional[Sequence[int]] = None, bias=None) -> torch.Tensor:
        """Integer timesteps t (B,) float32, σ = t / 1000."""
        if bias is not None and getattr(bias, "active", False):
            raise ConfigError("--timestep_bias_strategy: not supported for SD3; use --weighting_scheme")
        o = self.options
        u = density_samples(o.weighting_scheme, batch_size, generator, logit_mean=o.logit_mean,
                            logit_std=o.logit_std, mode_scale=o.mode_scale)
        u = u * o.training_shift / (1 + (o.training_shift - 1) * u)
        t_min = 0 if min_timestep is None else min_timestep
        t_max = NUM_TRAIN_TIMESTEPS if max_timestep is None else max_timestep
        t = (u * (t_max - t_min) + t_min).long().clamp(min=1)
        return t.float().to(device)

    @staticmethod
    def sigma_of(timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps.float() / NUM_TRAIN_TIMESTEPS

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_σ = (1 - σ)·x0 + σ·ε."""
        s = per_sample(self.sigma_of(timesteps), latents)
        return (1 - s) * latents + s * noise

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x0 (the latents), as sd-scripts' SD3 trainer compares."""
        return latents

    def prediction(self, model_output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The x0 estimate x_σ - σ·v of the model's velocity output v."""
        s = per_sample(self.sigma_of(timesteps), model_output)
        return noisy.to(model_output.dtype) - s * model_output

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        return loss_weighting(self.options.weighting_scheme, self.sigma_of(timesteps))

    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Noise-to-signal ratio σ / (1 - σ) (for the huber "snr" schedule)."""
        s = self.sigma_of(timesteps)
        return s / (1 - s)
