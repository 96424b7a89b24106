"""The training loss: elementwise loss type, mask, per-sample weights and SNR terms.

`training_loss` applies the sd-scripts terms in their fixed order:

1. elementwise loss (l2 / l1 / huber / smooth_l1), x mask weights: the mask
   area-resized to the latent size (as sd-scripts), then
   mask + unmasked_weight * (1 - mask) (OneTrainer's unmasked weight; 0 = sd-scripts),
   divided by its per-sample mean with normalize_masked_area_loss;
2. per-sample mean, x loss weight (e.g. the regularisation-image weight);
3. min-SNR-gamma weight (or its soft form, soft_min_snr_gamma);
4. scale_v_pred_loss_like_noise_pred;
5. v_pred_like_loss;
6. debiased estimation;
then the mean over the batch.

The scheme (library/objectives/noise.py) supplies `snr()`, `sigmas()` and
`prediction_type`; a scheme without SNR (rectified flow) rejects the SNR terms
in `check_loss_options` before training starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from library.core.errors import ConfigError

LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("snr", "exponential", "constant")

# sd-scripts caps the SNR at 1000 in the v-pred scaling and debiased terms: at t=0
# the SNR of the SD schedule is ~1175, and unbounded it would dominate the weights.
SNR_CAP = 1000.0


@dataclass
class LossOptions:
    """The loss flags (library/cli/noise_loss.py translates them)."""
    loss_type: str = "l2"
    huber_schedule: str = "snr"
    huber_c: float = 0.1
    huber_scale: float = 1.0
    min_snr_gamma: Optional[float] = None
    soft_min_snr_gamma: Optional[float] = None
    scale_v_pred_loss_like_noise_pred: bool = False
    v_pred_like_loss: Optional[float] = None
    debiased_estimation_loss: bool = False
    masked_loss: bool = False


def _is_v_pred(scheme) -> bool:
    return getattr(scheme, "prediction_type", "epsilon") == "v_prediction"


def _has_snr(scheme) -> bool:
    return bool(getattr(scheme, "has_snr", hasattr(scheme, "snr")))


def check_loss_options(options: LossOptions, scheme) -> None:
    """Reject option combinations that cannot work with this scheme (call before the first step)."""
    if options.loss_type not in LOSS_TYPES:
        raise ConfigError(f"--loss_type: expected one of {', '.join(LOSS_TYPES)}, got {options.loss_type!r}")
    if options.huber_schedule not in HUBER_SCHEDULES:
        raise ConfigError(f"--huber_schedule: expected one of {', '.join(HUBER_SCHEDULES)}, got {options.huber_schedule!r}")
    if options.loss_type in ("huber", "smooth_l1"):
        if not options.huber_c > 0:
            raise ConfigError(f"--huber_c: expected a number > 0, got {options.huber_c}")
        if options.huber_schedule == "snr" and not hasattr(scheme, "sigmas"):
            raise ConfigError(
                "--huber_schedule snr: this model's noise scheme has no SNR; use --huber_schedule exponential or constant"
            )
    if not _has_snr(scheme):
        for flag, value in (
            ("--min_snr_gamma", options.min_snr_gamma),
            ("--soft_min_snr_gamma", options.soft_min_snr_gamma),
            ("--scale_v_pred_loss_like_noise_pred", options.scale_v_pred_loss_like_noise_pred),
            ("--v_pred_like_loss", options.v_pred_like_loss),
            ("--debiased_estimation_loss", options.debiased_estimation_loss),
        ):
            if value:
                raise ConfigError(f"{flag}: needs an SNR-based (DDPM) model; this model's noise scheme has none")
        return
    if options.min_snr_gamma is not None and not options.min_snr_gamma > 0:
        raise ConfigError(f"--min_snr_gamma: expected a number > 0, got {options.min_snr_gamma}")
    if options.soft_min_snr_gamma is not None and not options.soft_min_snr_gamma > 0:
        raise ConfigError(f"--soft_min_snr_gamma: expected a number > 0, got {options.soft_min_snr_gamma}")
    if options.min_snr_gamma and options.soft_min_snr_gamma:
        raise ConfigError("--soft_min_snr_gamma: replaces --min_snr_gamma; set only one of them")
    if options.scale_v_pred_loss_like_noise_pred and not _is_v_pred(scheme):
        raise ConfigError("--scale_v_pred_loss_like_noise_pred: only valid with --v_parameterization")
    if options.v_pred_like_loss and _is_v_pred(scheme):
        raise ConfigError("--v_pred_like_loss: not valid with --v_parameterization (the model already predicts v)")


def huber_c_for(timesteps: torch.Tensor, scheme, options: LossOptions) -> torch.Tensor:
    """The huber / smooth_l1 threshold c per sample (B,), float32, on the timesteps' device.

    snr:         c = (1 - c0) / (1 + sigma_t)^2 + c0, sigma_t = sqrt((1 - ac) / ac)  (huber_scale unused)
    exponential: c = exp(ln(c0) * t / T) * huber_scale
    constant:    c = c0 * huber_scale
    """
    c0 = float(options.huber_c)
    if options.huber_schedule == "snr":
        sigmas = scheme.sigmas(timesteps).float()
        return ((1.0 - c0) / (1.0 + sigmas) ** 2 + c0).to(timesteps.device)
    if options.huber_schedule == "exponential":
        t_max = float(getattr(scheme, "num_train_timesteps", 1000))
        return torch.exp(math.log(c0) * timesteps.float() / t_max) * options.huber_scale
    if options.huber_schedule == "constant":
        return torch.full(timesteps.shape, c0 * options.huber_scale, dtype=torch.float32, device=timesteps.device)
    raise ConfigError(f"--huber_schedule: expected one of {', '.join(HUBER_SCHEDULES)}, got {options.huber_schedule!r}")


def elementwise_loss(pred: torch.Tensor, target: torch.Tensor, loss_type: str = "l2",
                     huber_c: Optional[torch.Tensor | float] = None) -> torch.Tensor:
    """Unreduced loss, same shape as `pred`, computed in float32.

    huber     = 2c (sqrt(d^2 + c^2) - c)   (pseudo-Huber: ~d^2 for |d| << c, ~2c|d| for |d| >> c)
    smooth_l1 = 2 (sqrt(d^2 + c^2) - c)
    `huber_c` is a float or a per-sample tensor (B,).
    """
    pred, target = pred.float(), target.float()
    if loss_type == "l2":
        return F.mse_loss(pred, target, reduction="none")
    if loss_type == "l1":
        return F.l1_loss(pred, target, reduction="none")
    if loss_type not in ("huber", "smooth_l1"):
        raise ConfigError(f"--loss_type: expected one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if huber_c is None:
        raise ValueError(f"elementwise_loss: loss_type {loss_type} needs huber_c")
    c = torch.as_tensor(huber_c, dtype=torch.float32, device=pred.device)
    if c.ndim == 1:
        c = c.reshape(-1, *([1] * (pred.ndim - 1)))
    smooth = torch.sqrt((pred - target) ** 2 + c**2) - c
    return 2 * c * smooth if loss_type == "huber" else 2 * smooth


def resize_mask(mask: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """(B,H,W) or (B,1,H,W) mask in [0,1] -> (B,1,*size) by area averaging."""
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return F.interpolate(mask.float(), size=tuple(size), mode="area")


def mask_weights(mask: torch.Tensor, size: tuple[int, ...], unmasked_weight: float | torch.Tensor = 0.0,
                 normalize: bool | torch.Tensor = False) -> torch.Tensor:
    """(B,1,*size) loss weights of a (B,[1,]H,W) mask in [0,1]: w = m + unmasked_weight * (1 - m), m the
    area-resized mask; where `normalize`, w / mean(w) per sample (a sample whose weights are all 0 stays 0).

    `unmasked_weight` and `normalize` are one value or one per sample (B,).
    """
    m = resize_mask(mask, size)
    b, view = m.shape[0], (-1,) + (1,) * (m.ndim - 1)
    uw = torch.as_tensor(unmasked_weight, dtype=m.dtype, device=m.device)
    uw = uw.reshape(view) if uw.ndim else uw
    w = m + uw * (1.0 - m) if (uw.ndim or float(uw) != 0.0) else m
    norm = torch.as_tensor(normalize, dtype=torch.bool, device=m.device)
    if bool(norm.any()):
        mean = w.mean(dim=tuple(range(1, w.ndim)), keepdim=True)
        divide = norm.reshape(view).expand(b, *([1] * (m.ndim - 1))) & (mean > 0)
        w = torch.where(divide, w / torch.where(mean > 0, mean, torch.ones_like(mean)), w)
    return w


def min_snr_weight(snr: torch.Tensor, gamma: float, v_prediction: bool) -> torch.Tensor:
    """Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR; for v-pred min(SNR, gamma) / (SNR + 1)."""
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if v_prediction else clipped / snr


def soft_min_snr_weight(snr: torch.Tensor, gamma: float, v_prediction: bool) -> torch.Tensor:
    """Soft min-SNR: min-SNR with min(SNR, gamma) replaced by the smooth SNR·gamma / (SNR + gamma).

    eps: gamma / (SNR + gamma);  v: SNR·gamma / ((SNR + gamma)(SNR + 1)).
    """
    if v_prediction:
        return snr * gamma / ((snr + gamma) * (snr + 1))
    return gamma / (snr + gamma)


def v_pred_noise_scale(snr: torch.Tensor) -> torch.Tensor:
    """SNR / (SNR + 1) with SNR capped at 1000: scales a v-pred loss to an eps-pred loss's size."""
    capped = torch.clamp(snr, max=SNR_CAP)
    return capped / (capped + 1)


def debiased_weight(snr: torch.Tensor, v_prediction: bool) -> torch.Tensor:
    """Debiased estimation: 1 / sqrt(SNR) (v-pred: 1 / (SNR + 1)), SNR capped at 1000."""
    capped = torch.clamp(snr, max=SNR_CAP)
    return 1 / (capped + 1) if v_prediction else 1 / torch.sqrt(capped)


def _on(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def training_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    timesteps: torch.Tensor,
    scheme,
    options: LossOptions,
    loss_weights: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    unmasked_weight: float | torch.Tensor = 0.0,
    normalize_masked_area: bool | torch.Tensor = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scalar loss to backpropagate and the weighted per-sample losses (B,), in float32.

    `mask` (B,1,H,W) or (B,H,W) weights the elementwise loss where given (see mask_weights);
    `unmasked_weight` / `normalize_masked_area` are one value or one per sample (B,).
    """
    huber_c = None
    if options.loss_type in ("huber", "smooth_l1"):
        huber_c = huber_c_for(timesteps, scheme, options).to(pred.device)
    loss = elementwise_loss(pred, target, options.loss_type, huber_c)
    if mask is not None:
        loss = loss * mask_weights(mask.to(loss.device), loss.shape[2:], _on(unmasked_weight, loss.device),
                                   _on(normalize_masked_area, loss.device))
    per_sample = loss.mean(dim=tuple(range(1, loss.ndim)))
    if loss_weights is not None:
        per_sample = per_sample * loss_weights.to(per_sample)

    uses_snr = (options.min_snr_gamma or options.soft_min_snr_gamma or options.scale_v_pred_loss_like_noise_pred
                or options.v_pred_like_loss or options.debiased_estimation_loss)
    if uses_snr:
        snr = scheme.snr(timesteps).float().to(per_sample.device)
        v_pred = _is_v_pred(scheme)
        if options.min_snr_gamma:
            per_sample = per_sample * min_snr_weight(snr, options.min_snr_gamma, v_pred)
        if options.soft_min_snr_gamma:
            per_sample = per_sample * soft_min_snr_weight(snr, options.soft_min_snr_gamma, v_pred)
        if options.scale_v_pred_loss_like_noise_pred:
            per_sample = per_sample * v_pred_noise_scale(snr)
        if options.v_pred_like_loss:
            per_sample = per_sample + per_sample / v_pred_noise_scale(snr) * options.v_pred_like_loss
        if options.debiased_estimation_loss:
            per_sample = per_sample * debiased_weight(snr, v_pred)
    return per_sample.mean(), per_sample
