"""Range checks of every numeric training flag, before anything is read or loaded.

One table: flag -> the values that can work. A value outside is a one-line ConfigError naming the flag, the
value and the expected range (exit code 2). Every float flag must also be finite (`nan`, `inf` and overflowing
literals are refused). Checks that need the loaded model (--clip_skip against the encoder's depth) are
`ModelFamily.check_loaded`, called right after the model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from library.core.errors import ConfigError

MAX_LEARNING_RATE = 10.0  # no optimizer here trains above it; DAdaptation / Prodigy use 1.0
MAX_SEED = 2**32 - 1  # NumPy's seed range


@dataclass(frozen=True)
class Range:
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False  # lo itself is outside
    hi_open: bool = False
    integer: bool = False
    note: str = ""

    def contains(self, value: float) -> bool:
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return not (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        g = lambda v: f"{v:g}" if not self.integer else str(int(v))  # noqa: E731
        if self.lo is not None and self.hi is not None:
            left, right = ("(" if self.lo_open else "["), (")" if self.hi_open else "]")
            text = f"{kind} in {left}{g(self.lo)}, {g(self.hi)}{right}"
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {g(self.lo)}"
        elif self.hi is not None:
            text = f"{kind} {'<' if self.hi_open else '<='} {g(self.hi)}"
        else:
            text = f"a finite {'integer' if self.integer else 'number'}"
        return f"{text} ({self.note})" if self.note else text


def _at_least(n: int, note: str = "") -> Range:
    return Range(lo=n, integer=True, note=note)


_LR = Range(0, MAX_LEARNING_RATE, note=f"learning rates above {MAX_LEARNING_RATE:g} do not train; "
                                       "DAdaptation/Prodigy use 1.0")
_RATE = Range(0, 1)

RANGES: dict[str, Range] = {
    # model and text
    "clip_skip": _at_least(1, "checked against the encoder's layer count when the model loads"),
    # dataset
    "dataset_repeats": _at_least(1), "train_batch_size": _at_least(1), "min_bucket_reso": _at_least(1),
    "max_bucket_reso": _at_least(1), "bucket_reso_steps": _at_least(1), "keep_tokens": _at_least(0),
    "token_warmup_min": _at_least(0), "token_warmup_step": Range(lo=0),
    "caption_dropout_rate": _RATE, "caption_dropout_every_n_epochs": _at_least(0),
    "caption_tag_dropout_rate": _RATE, "prior_loss_weight": Range(lo=0), "vae_batch_size": _at_least(1),
    "max_data_loader_n_workers": _at_least(0), "validation_split": Range(0, 1, hi_open=True),
    "validation_seed": Range(0, MAX_SEED, integer=True), "min_image_side": _at_least(0),
    "max_aspect_ratio": Range(lo=0, note="0 = no limit"),
    # network
    "network_dim": _at_least(1), "network_alpha": Range(lo=0), "network_dropout": _RATE,
    "unet_lr": _LR, "text_encoder_lr": _LR, "scale_weight_norms": Range(lo=0, lo_open=True),
    "network_multiplier": Range(), "base_weights_multiplier": Range(),
    # fine-tune and EMA
    "learning_rate_te": _LR, "learning_rate_te1": _LR, "learning_rate_te2": _LR, "learning_rate_te3": _LR,
    "ema_decay": Range(0, 1, lo_open=True, hi_open=True), "ema_update_every": _at_least(1),
    "ema_start_step": _at_least(0),
    # optimizer and schedule
    "learning_rate": _LR, "max_grad_norm": Range(lo=0, note="0 = no clipping"),
    "lr_scheduler_num_cycles": _at_least(1), "lr_scheduler_power": Range(lo=0),
    "lr_scheduler_timescale": _at_least(1), "lr_scheduler_min_lr_ratio": _RATE,
    # noise and loss
    "noise_offset": Range(lo=0), "adaptive_noise_scale": Range(), "multires_noise_iterations": _at_least(1),
    "multires_noise_discount": Range(0, 1, lo_open=True), "ip_noise_gamma": Range(lo=0),
    "min_timestep": Range(0, 1000, integer=True), "max_timestep": Range(0, 1000, integer=True),
    "huber_c": Range(lo=0, lo_open=True), "huber_scale": Range(lo=0, lo_open=True),
    "fused_optimizer_groups": _at_least(1),
    "min_snr_gamma": Range(lo=0, lo_open=True), "soft_min_snr_gamma": Range(lo=0, lo_open=True),
    "timestep_bias_multiplier": Range(lo=0, lo_open=True), "timestep_bias_portion": Range(0, 1, lo_open=True),
    "timestep_bias_begin": Range(0, 1000, integer=True), "timestep_bias_end": Range(0, 1000, integer=True),
    "unmasked_probability": _RATE, "unmasked_weight": _RATE, "v_pred_like_loss": Range(lo=0, lo_open=True),
    # saving, steps, logging, validation
    "save_every_n_epochs": _at_least(1), "save_n_epoch_ratio": _at_least(1), "save_every_n_steps": _at_least(1),
    "save_last_n_epochs": _at_least(1), "save_last_n_epochs_state": _at_least(1), "save_last_n_steps": _at_least(1),
    "save_last_n_steps_state": _at_least(1), "max_train_steps": _at_least(1), "max_train_epochs": _at_least(1),
    "seed": Range(0, MAX_SEED, integer=True), "gradient_accumulation_steps": _at_least(1),
    "log_every_n_steps": _at_least(1), "log_tflops": _at_least(1), "validate_every_n_steps": _at_least(1),
    "validate_every_n_epochs": _at_least(1), "max_validation_steps": _at_least(1), "ddp_timeout": _at_least(1),
    "zero_stage": Range(0, 3, integer=True, note="DeepSpeed ZeRO stage"),
    # memory and sampling
    "blocks_to_swap": _at_least(1), "sample_every_n_steps": _at_least(0, "0 = off"),
    "sample_every_n_epochs": _at_least(0, "0 = off"), "sample_batch_size": _at_least(1),
    # FLUX.1 and flow matching
    "guidance_scale": Range(lo=0), "t5xxl_max_token_length": _at_least(1), "sigmoid_scale": Range(lo=0, lo_open=True),
    "discrete_flow_shift": Range(lo=0, lo_open=True), "logit_mean": Range(), "logit_std": Range(lo=0, lo_open=True),
    "mode_scale": Range(),
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ranges(values: Mapping[str, Any]) -> None:
    """ConfigError for the first numeric flag out of its range or not finite (values: vars(namespace))."""
    for name, value in sorted(values.items()):  # .items(): a check, not a use (tests/test_flag_audit.py)
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if not _number(item):
                continue
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"--{name} {item}: expected a finite number")
            rule = RANGES.get(name)
            if rule is not None and not rule.contains(item):
                raise ConfigError(f"--{name} {item if isinstance(item, int) else format(item, 'g')}: "
                                  f"expected {rule.describe()}")


def check_resolution_steps(resolution: Optional[str], enable_bucket: bool, model_multiple: int) -> None:
    """Without --enable_bucket every --resolution side is trained as given, so it must be a multiple of what the
    model needs (its bucket step: 64 for SD 1.x/2.x, 32 for SDXL/FLUX.1); with buckets the sides only set the
    area (sd-scripts' rule), checked by the data layer."""
    if not resolution or enable_bucket:
        return
    for part in str(resolution).split(";"):
        for side in part.split(","):
            side = side.strip()
            if side.isdigit() and int(side) % model_multiple:
                raise ConfigError(f"--resolution {resolution}: expected sides that are multiples of {model_multiple} "
                                  f"for this model without --enable_bucket, got {side}")
