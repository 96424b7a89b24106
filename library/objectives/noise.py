"""Noise and timesteps for DDPM-style training (SD 1.x / 2.x / SDXL).

`DDPMScheme` is the forward process: which timesteps to train on, how to noise
latents, what the model must predict and the per-timestep SNR used by the loss
weights. `make_noise` / `perturb_for_input` build the noise itself with the
sd-scripts options (offset noise, multires "pyramid" noise, input perturbation).

Every random draw goes through the `torch.Generator` passed in, so a loop that
saves and restores the generator state resumes with the exact same noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from library.core.errors import ConfigError
from library.objectives.timestep_bias import TimestepBias, biased_integer_timesteps

PREDICTION_TYPES = ("epsilon", "v_prediction")
BETA_SCHEDULES = ("scaled_linear", "linear", "squaredcos_cap_v2")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")

# SNR at a zero-terminal-SNR timestep is exactly 0, which turns the min-SNR and
# debiased weights into 0/0 or 1/0. Flooring it keeps every weight finite and at
# its limit value (min-SNR eps -> 1, v-pred weights -> ~0).
SNR_FLOOR = 1e-8


def randn(shape, generator: Optional[torch.Generator], device, dtype=torch.float32) -> torch.Tensor:
    """N(0,1) of `shape` on `device`, drawn from `generator` (on the generator's own device) if given."""
    if generator is None:
        return torch.randn(shape, device=device, dtype=torch.float32).to(dtype)
    out = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
    return out.to(device=device, dtype=dtype)


def rand(shape, generator: Optional[torch.Generator], device) -> torch.Tensor:
    """U[0,1) of `shape` on `device`, drawn from `generator` if given."""
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def _per_sample(values: torch.Tensor, ndim: int) -> torch.Tensor:
    """(B,) -> (B, 1, ..., 1) broadcastable against a tensor of `ndim` dims."""
    return values.reshape(values.shape[0], *([1] * (ndim - 1)))


class NoiseScheme(Protocol):
    """What the loop and the losses ask of a training scheme (DDPMScheme here, flow.FlowMatchScheme)."""
    def sample_timesteps(self, batch_size: int, min_timestep: Optional[int] = None,
                         max_timestep: Optional[int] = None, generator: Optional[torch.Generator] = None,
                         device: Any = "cpu", latent_shape: Optional[Sequence[int]] = None,
                         bias: Optional[TimestepBias] = None) -> torch.Tensor: ...

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    def prediction(self, model_output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor: ...

    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class DDPMSchedule:
    """The DDPM noise-schedule settings a run may override (--noise_scheduler_overrides, --timestep_spacing,
    --zero_terminal_snr). Defaults are Stable Diffusion's (SD 1.x, 2.x and SDXL ship the same schedule)."""
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    zero_terminal_snr: bool = False  # rescale_betas_zero_snr in a scheduler config
    timestep_spacing: Optional[str] = None  # sampling only: training draws every integer timestep

    def check(self) -> None:
        """One-line ConfigError for a value the schedule cannot use."""
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, int) \
                or self.num_train_timesteps < 2:
            raise ConfigError(f"num_train_timesteps: expected an integer >= 2, got {self.num_train_timesteps!r}")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ConfigError(f"beta_schedule: expected one of {', '.join(BETA_SCHEDULES)}, got {self.beta_schedule!r}")
        if not 0 < self.beta_start < 1 or not 0 < self.beta_end < 1:
            raise ConfigError(f"beta_start/beta_end: expected numbers in (0, 1), got {self.beta_start} and {self.beta_end}")
        if self.beta_start > self.beta_end:
            raise ConfigError(f"beta_start ({self.beta_start}) is above beta_end ({self.beta_end})")
        if self.timestep_spacing is not None and self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ConfigError(f"timestep_spacing: expected one of {', '.join(TIMESTEP_SPACINGS)}, "
                              f"got {self.timestep_spacing!r}")

    def sampler_config(self) -> dict:
        """The diffusers scheduler keys this schedule sets for sample images (zero terminal SNR is training-only)."""
        config = {"num_train_timesteps": self.num_train_timesteps, "beta_start": self.beta_start,
                  "beta_end": self.beta_end, "beta_schedule": self.beta_schedule}
        if self.timestep_spacing is not None:
            config["timestep_spacing"] = self.timestep_spacing
        return config


def make_betas(beta_schedule: str, num_train_timesteps: int, beta_start: float, beta_end: float) -> torch.Tensor:
    """float32 betas exactly as diffusers' DDPMScheduler builds them for `beta_schedule`."""
    if beta_schedule == "scaled_linear":
        return torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float32) ** 2
    if beta_schedule == "linear":
        return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
    if beta_schedule == "squaredcos_cap_v2":  # Nichol & Dhariwal's cosine schedule, beta capped at 0.999
        def alpha_bar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        n = num_train_timesteps
        return torch.tensor([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)],
                            dtype=torch.float32)
    raise ConfigError(f"beta_schedule: expected one of {', '.join(BETA_SCHEDULES)}, got {beta_schedule!r}")


class DDPMScheme:
    """The DDPM forward process used by Stable Diffusion (scaled-linear betas unless overridden).

    Numerically identical to diffusers' `DDPMScheduler(beta_schedule=...)` (and, with
    `zero_terminal_snr`, to its `rescale_betas_zero_snr=True`): the betas are built in
    float32 exactly as diffusers does, because that is what sd-scripts trains with and
    bit-equal noising keeps results reproducible.
    """
    has_snr = True  # loss weights based on SNR apply (a flow-matching scheme sets False)

    def __init__(
        self,
        prediction_type: str = "epsilon",
        zero_terminal_snr: bool = False,
        num_train_timesteps: int = 1000,
        beta_start: float = 0.00085,
        beta_end: float = 0.012,
        beta_schedule: str = "scaled_linear",
    ):
        if prediction_type not in PREDICTION_TYPES:
            raise ConfigError(f"prediction_type: expected one of {', '.join(PREDICTION_TYPES)}, got {prediction_type!r}")
        self.prediction_type = prediction_type
        self.zero_terminal_snr = zero_terminal_snr
        self.num_train_timesteps = int(num_train_timesteps)
        self.beta_schedule = beta_schedule
        betas = make_betas(beta_schedule, self.num_train_timesteps, beta_start, beta_end)
        if zero_terminal_snr:
            betas = rescale_betas_zero_terminal_snr(betas)
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)

    @classmethod
    def from_schedule(cls, schedule: Optional[DDPMSchedule], prediction_type: str = "epsilon",
                      zero_terminal_snr: bool = False) -> "DDPMScheme":
        """The scheme of a run: its schedule overrides (None: SD's), zero terminal SNR if either asks for it."""
        s = schedule or DDPMSchedule()
        return cls(prediction_type=prediction_type, zero_terminal_snr=zero_terminal_snr or s.zero_terminal_snr,
                   num_train_timesteps=s.num_train_timesteps, beta_start=s.beta_start, beta_end=s.beta_end,
                   beta_schedule=s.beta_schedule)

    @property
    def v_prediction(self) -> bool:
        return self.prediction_type == "v_prediction"

    @property
    def validation_timesteps(self) -> tuple[int, ...]:
        """The fixed validation timesteps: 200, 400, 600, 800 of 1000 (the same fractions of another count)."""
        return tuple(self.num_train_timesteps * k // 5 for k in range(1, 5))

    # --- timesteps ----------------------------------------------------------
    def prediction(self, model_output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The model output compared with `target`: as is for DDPM (flow schemes may rescale it)."""
        return model_output

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Per-sample weight of the scheme itself: none for DDPM (SNR weights are loss options)."""
        return torch.ones(timesteps.shape[0])

    def sample_timesteps(
        self,
        batch_size: int,
        min_timestep: Optional[int] = 0,
        max_timestep: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        device="cpu",
        latent_shape: Optional[tuple] = None,  # part of the scheme interface; DDPM sampling ignores it
        bias: Optional[TimestepBias] = None,
    ) -> torch.Tensor:
        """Integer timesteps uniform in [min_timestep, max_timestep); equal bounds give that fixed timestep.

        With an active `bias` the draw is weighted by it (library/objectives/timestep_bias.py).
        """
        lo = 0 if min_timestep is None else int(min_timestep)
        hi = self.num_train_timesteps if max_timestep is None else int(max_timestep)
        if not 0 <= lo <= hi <= self.num_train_timesteps:
            raise ConfigError(
                f"--min_timestep/--max_timestep: expected 0 <= min <= max <= {self.num_train_timesteps}, got {lo} and {hi}"
            )
        if lo == hi:
            # sd-scripts semantics: equal bounds pin the timestep (useful for debugging a schedule).
            return torch.full((batch_size,), min(lo, self.num_train_timesteps - 1), dtype=torch.long, device=device)
        if bias is not None and bias.active:
            t = biased_integer_timesteps(bias, batch_size, lo, hi, self.num_train_timesteps, generator)
            return t.to(device=device, dtype=torch.long)
        if generator is None:
            t = torch.randint(lo, hi, (batch_size,))
        else:
            t = torch.randint(lo, hi, (batch_size,), generator=generator, device=generator.device)
        return t.to(device=device, dtype=torch.long)

    def _ac(self, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        ac = self.alphas_cumprod.to(like.device)[timesteps.to(like.device).long()]
        return _per_sample(ac.to(like.dtype), like.ndim)

    # --- forward process --------------------------------------------------------
    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(ac_t) * x_0 + sqrt(1 - ac_t) * noise."""
        ac = self._ac(timesteps, latents)
        return ac**0.5 * latents + (1 - ac) ** 0.5 * noise

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What the model is trained to predict: the noise (epsilon) or the velocity v."""
        if not self.v_prediction:
            return noise
        ac = self._ac(timesteps, latents)
        return ac**0.5 * noise - (1 - ac) ** 0.5 * latents

    # --- per-timestep quantities used by losses --------------------------------
    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio ac / (1 - ac) per timestep, floored at SNR_FLOOR, float32 (B,)."""
        ac = self.alphas_cumprod.to(timesteps.device)[timesteps.long()]
        return (ac / (1.0 - ac)).clamp_min(SNR_FLOOR)

    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Noise-to-signal ratio sqrt((1 - ac) / ac) per timestep (B,); inf at a zero-SNR timestep."""
        ac = self.alphas_cumprod.to(timesteps.device)[timesteps.long()]
        return ((1.0 - ac) / ac) ** 0.5


def rescale_betas_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Rescale betas so the last timestep has SNR 0 (Lin et al. 2023, "Common Diffusion
    Noise Schedules and Sample Steps are Flawed", Algorithm 1).

    sqrt(alphas_cumprod) is shifted so its last value is 0 and scaled so its first
    value is unchanged; the betas are then recovered from the new cumulative product.
    """
    sqrt_ac = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first, last = sqrt_ac[0].clone(), sqrt_ac[-1].clone()
    sqrt_ac = (sqrt_ac - last) * (first / (first - last))
    ac = sqrt_ac**2
    alphas = torch.cat([ac[0:1], ac[1:] / ac[:-1]])
    return 1.0 - alphas


@dataclass
class NoiseOptions:
    """The noise and timestep flags (library/cli/noise_loss.py translates them)."""
    noise_offset: Optional[float] = None
    noise_offset_random_strength: bool = False
    adaptive_noise_scale: Optional[float] = None
    multires_noise_iterations: Optional[int] = None
    multires_noise_discount: float = 0.3
    ip_noise_gamma: Optional[float] = None
    ip_noise_gamma_random_strength: bool = False
    min_timestep: Optional[int] = None
    max_timestep: Optional[int] = None
    timestep_bias: Optional[TimestepBias] = None  # None or inactive: the scheme's own sampling, untouched


def make_noise(latents: torch.Tensor, options: NoiseOptions, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The noise a batch is trained with: N(0,1) like `latents`, plus offset and multires noise.

    Draw order (fixed, so resumed runs replay it): base noise; offset strength
    (if random); per-channel offset; then one scale and one noise map per multires level.
    """
    device, dtype = latents.device, latents.dtype
    noise = randn(latents.shape, generator, device, dtype)
    if options.noise_offset:
        noise = apply_noise_offset(latents, noise, options, generator)
    if options.multires_noise_iterations:
        noise = pyramid_noise(noise, options.multires_noise_iterations, options.multires_noise_discount, generator)
    return noise


def apply_noise_offset(latents: torch.Tensor, noise: torch.Tensor, options: NoiseOptions,
                       generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """noise + o * N(0,1)[B, C, 1, 1]: a random constant per sample and channel.

    With `noise_offset_random_strength` o ~ U(0, noise_offset); with
    `adaptive_noise_scale` a, o += a * |channel mean of the latents| (clamped at 0).
    """
    offset: torch.Tensor | float = options.noise_offset
    if options.noise_offset_random_strength:
        offset = rand((1,), generator, latents.device) * options.noise_offset
    if options.adaptive_noise_scale is not None:
        channel_mean = latents.mean(dim=tuple(range(2, latents.ndim)), keepdim=True).abs()
        offset = (offset + options.adaptive_noise_scale * channel_mean).clamp_min(0.0)
    shape = (latents.shape[0], latents.shape[1]) + (1,) * (latents.ndim - 2)
    return noise + offset * randn(shape, generator, latents.device, noise.dtype)


def pyramid_noise(noise: torch.Tensor, iterations: int, discount: float,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Multi-resolution noise: add noise drawn at size (H, W) / r^i, upsampled bilinearly and
    weighted discount^i, for i = 0..iterations-1 with r ~ U(2, 4) per level; stop at 1 pixel;
    then divide by the overall std so the result has roughly unit variance.
    """
    b, c, h, w = noise.shape
    out = noise.clone()
    for i in range(iterations):
        r = float(rand((1,), generator, "cpu")) * 2 + 2
        hn, wn = max(1, int(h / r**i)), max(1, int(w / r**i))
        level = randn((b, c, hn, wn), generator, noise.device, torch.float32)
        up = F.interpolate(level, size=(h, w), mode="bilinear", align_corners=False)
        out = out + (up * discount**i).to(noise.dtype)
        if hn == 1 or wn == 1:
            break
    return out / out.std()


def perturb_for_input(noise: torch.Tensor, options: NoiseOptions, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Input perturbation (`ip_noise_gamma`): the noise used to build the model *input*.

    Returns noise + gamma * N(0,1) (gamma ~ U(0, ip_noise_gamma) with random strength);
    the training target keeps using the unperturbed `noise`. Without the option
    returns `noise` itself and draws nothing.
    """
    if not options.ip_noise_gamma:
        return noise
    gamma: torch.Tensor | float = options.ip_noise_gamma
    if options.ip_noise_gamma_random_strength:
        gamma = rand((1,), generator, noise.device) * options.ip_noise_gamma
    return noise + gamma * randn(noise.shape, generator, noise.device, noise.dtype)
