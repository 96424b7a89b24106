"""Flags of a full fine-tune (fine_tune.py, sdxl_train.py, flux_train.py) and of EMA, and their typed forms."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from library.cli.options import (
    LEARNING_RATE,
    Range,
    at_least,
    flag,
    flag_specs,
    flag_values,
    settings_from,
)
from library.core.errors import ConfigError
from library.train.settings import EmaOptions, FineTuneOptions

MODEL_FORMATS = ["ckpt", "safetensors", "diffusers", "diffusers_safetensors"]


@dataclass
class MetadataFlags:
    """--metadata_* (modelspec.*), shared by LoRA and full-model training."""
    metadata_title: Optional[str] = flag(None, "modelspec.title (default: output name)")
    metadata_author: Optional[str] = flag(None, "modelspec.author")
    metadata_description: Optional[str] = flag(None, "modelspec.description")
    metadata_license: Optional[str] = flag(None, "modelspec.license")
    metadata_tags: Optional[str] = flag(None, "modelspec.tags (comma-separated)")
    metadata_usage_hint: Optional[str] = flag(None, "modelspec.usage_hint (a short hint on how to use the model)")
    metadata_thumbnail: Optional[str] = flag(None, "modelspec.thumbnail: a data: URL, or an image file written into "
                                                   "the metadata as one")
    metadata_merged_from: Optional[str] = flag(None, "modelspec.merged_from (the models this one was merged from)")
    metadata_trigger_phrase: Optional[str] = flag(None, "modelspec.trigger_phrase")
    metadata_preprocessor: Optional[str] = flag(None, "modelspec.preprocessor (the preprocessing the images need)")
    metadata_is_negative_embedding: Optional[str] = flag(None, "modelspec.is_negative_embedding")


def metadata_from_args(ns) -> dict:
    """The --metadata_* values; a --metadata_thumbnail that is neither a data: URL nor a file stops here (sd-scripts
    drops it with a warning after training)."""
    values = flag_values(ns, MetadataFlags)
    thumbnail = values.get("metadata_thumbnail")
    if thumbnail and not thumbnail.startswith("data:") and not os.path.isfile(thumbnail):
        raise ConfigError(f"--metadata_thumbnail {thumbnail}: file not found; expected an image file or a data: URL")
    return values


@dataclass
class DreamBoothFlags:
    """train_db.py's own flags (sd-scripts' DreamBooth script: a full fine-tune whose text encoder trains by
    default)."""
    flag_group: ClassVar[str] = "DreamBooth (train_db.py)"
    stop_text_encoder_training: Optional[int] = flag(None, "train the text encoder for the first N steps only (-1 or"
                                                           " 0: never; default: the whole run)", range=at_least(-1))
    no_token_padding: bool = flag(False, "accepted for sd-scripts compatibility: sd-scripts sets it and reads it "
                                         "nowhere (the code using it is commented out)")


@dataclass
class FineTuneFlags:
    flag_group: ClassVar[str] = "fine-tuning"
    train_text_encoder: bool = flag(False, "also train the text encoder(s); each trains unless its learning rate is 0")
    use_safetensors: bool = flag(False, "accepted for sd-scripts compatibility: safetensors is already the default "
                                        "--save_model_as")
    learning_rate_te: Optional[float] = flag(None, "learning rate of every text encoder (default: --learning_rate)",
                                                   range=LEARNING_RATE)
    learning_rate_te1: Optional[float] = flag(None, "learning rate of the first text encoder (SDXL: CLIP-L); "
                                                    "overrides --learning_rate_te", range=LEARNING_RATE)
    learning_rate_te2: Optional[float] = flag(None, "learning rate of the second text encoder (SDXL: OpenCLIP-G); "
                                                    "overrides --learning_rate_te", range=LEARNING_RATE)
    block_lr: Optional[str] = flag(None, "comma-separated learning rates, one per UNet block (SDXL: 23 values: "
                                         "embeddings, IN00-IN08, MID0-MID2, OUT00-OUT08, out); 0 freezes that block")
    mem_eff_save: bool = flag(False, "write checkpoints tensor by tensor, without a second copy of the model in "
                                     "memory")
    fused_optimizer_groups: Optional[int] = flag(None, "cut the parameters into N groups, each stepped (and its "
                                                       "gradients freed) as soon as all of its gradients are in: like"
                                                       " --fused_backward_pass with N optimizers", range=at_least(1))
    blockwise_fused_optimizers: bool = flag(False, "FLUX.1: one optimizer per transformer block (each double block, "
                                                   "each single block, the rest), stepped during backward as soon as "
                                                   "its block's gradients are in")
    fused_backward_pass: bool = flag(False, "step each parameter as soon as its gradient is complete: the gradients "
                                            "of the whole model are never held at once (no gradient accumulation)")
    metadata: MetadataFlags = field(default_factory=MetadataFlags)


@dataclass
class T5xxlFineTuneFlags:
    """sd3_train.py's --train_t5xxl and --learning_rate_te3 (a family with a fine_tune_t5xxl_encoder)."""
    flag_group: ClassVar[str] = "fine-tuning T5-XXL"
    train_t5xxl: bool = flag(False, "with --train_text_encoder, train T5-XXL too (its outputs cannot be cached then)")
    learning_rate_te3: Optional[float] = flag(None, "learning rate of T5-XXL with --train_t5xxl (default: "
                                                    "--learning_rate_te, else --learning_rate; 0 keeps it frozen)",
                                                    range=LEARNING_RATE)
    use_t5xxl_cache_only: bool = flag(False, "cache the T5-XXL outputs (turns on --cache_text_encoder_outputs) while "
                                             "CLIP-L/G train with --train_text_encoder (frozen CLIP outputs are "
                                             "cached too: the same numbers)")


@dataclass
class EmaFlags:
    flag_group: ClassVar[str] = "EMA (moving average of the trained weights)"
    use_ema: bool = flag(False, "keep an EMA of the trained weights and save it")
    ema_decay: float = flag(0.9999, "EMA decay (default 0.9999)", range=Range(0, 1, lo_open=True, hi_open=True))
    ema_no_warmup: bool = flag(False, "use --ema_decay from the first update (default: min(decay, (1+t)/(10+t)) at "
                                      "update t)")
    ema_update_every: int = flag(1, "update the EMA every N optimizer steps", range=at_least(1))
    ema_device: str = flag("cpu", "where the EMA weights live: cpu (default) or the training device",
                                  choices=("cpu", "same"))
    ema_start_step: int = flag(0, "start the EMA at this optimizer step", range=at_least(0))
    save_ema_only: bool = flag(True, "save only the EMA weights (default true); false also saves the trained ones as "
                                     "<name>-nonema")
    ema_for_sampling: bool = flag(True, "sample images with the EMA weights (default true)")
    ema_for_validation: bool = flag(True, "compute the validation loss with the EMA weights (default true)")


def block_lrs_from_args(value, family) -> list[float]:
    """--block_lr "a,b,...": one finite rate >= 0 per block of the family's layout."""
    if not value:
        return []
    layout = family.lora_block_layout()
    if layout is None:
        raise ConfigError(f"--block_lr: {family.name} has no UNet block layout; it is for SDXL")
    try:
        rates = [float(v) for v in str(value).split(",")]
    except ValueError:
        raise ConfigError(f"--block_lr {value}: expected {layout.num_blocks} comma-separated numbers") from None
    if len(rates) != layout.num_blocks or any(not (0 <= r < float("inf")) for r in rates):
        raise ConfigError(f"--block_lr: expected {layout.num_blocks} comma-separated rates >= 0 ({layout.names}), "
                          f"got {len(rates)}")
    return rates


def fine_tune_options_from_args(ns: argparse.Namespace, family=None) -> FineTuneOptions:
    """FineTuneOptions; the checks are those of flag combinations (each flag's own range is declared)."""
    chosen = [name for name, on in (("--fused_backward_pass", ns.fused_backward_pass),
                                    ("--fused_optimizer_groups", ns.fused_optimizer_groups),
                                    ("--blockwise_fused_optimizers", ns.blockwise_fused_optimizers)) if on]
    if len(chosen) > 1:
        raise ConfigError(f"{chosen[1]}: not with {chosen[0]}; choose one")
    fused = chosen[0] if chosen else None
    # A family with a block layout for it names a block for every parameter; the others name none.
    if ns.blockwise_fused_optimizers and family is not None and family.optimizer_block("") is None:
        raise ConfigError(f"--blockwise_fused_optimizers: not for {family.name}; it groups FLUX.1's double and "
                          "single blocks (use --fused_backward_pass or --fused_optimizer_groups)")
    if fused and ns.gradient_accumulation_steps > 1:
        raise ConfigError(f"{fused}: gradients are applied during backward, so it cannot accumulate "
                          f"them; drop --gradient_accumulation_steps {ns.gradient_accumulation_steps}")
    if fused and ns.mixed_precision == "fp16" and not ns.full_fp16:
        raise ConfigError(f"{fused}: not with --mixed_precision fp16 (loss scaling must see every "
                          "gradient before a step); use bf16, or --full_fp16")
    for name, on in (("fp8_base", ns.fp8_base), ("fp8_base_unet", ns.fp8_base_unet)):
        if on:
            raise ConfigError(f"--{name}: float8 weights cannot be trained; it is for LoRA training only")
    train_t5xxl = bool(getattr(ns, "train_t5xxl", False))  # T5xxlFineTuneFlags: only some families have them
    if train_t5xxl and not ns.train_text_encoder:
        raise ConfigError("--train_t5xxl: needs --train_text_encoder (CLIP-L and CLIP-G train with T5-XXL, as in "
                          "sd-scripts)")
    if train_t5xxl and (ns.cache_text_encoder_outputs or getattr(ns, "cache_text_encoder_outputs_to_disk", False)):
        raise ConfigError("--train_t5xxl: T5-XXL's outputs cannot be cached while it trains; drop "
                          "--cache_text_encoder_outputs")
    train_text_encoder = ns.train_text_encoder
    if hasattr(ns, "stop_text_encoder_training"):  # train_db.py: the text encoder trains unless told otherwise
        stop = ns.stop_text_encoder_training
        train_text_encoder = stop is None or stop > 0
        if ns.train_text_encoder and not train_text_encoder:
            raise ConfigError(f"--train_text_encoder with --stop_text_encoder_training {stop}: the second says the "
                              "text encoder never trains; drop one")
    te3 = getattr(ns, "learning_rate_te3", None)
    if te3 is not None and not train_t5xxl:
        raise ConfigError("--learning_rate_te3: T5-XXL trains only with --train_t5xxl; add it or drop the rate")
    return settings_from(FineTuneOptions, ns, train_text_encoder=train_text_encoder, learning_rate_te_each=[ns.learning_rate_te1, ns.learning_rate_te2, te3],
                         train_t5xxl=train_t5xxl, block_lr=block_lrs_from_args(ns.block_lr, family),
                         metadata=metadata_from_args(ns))


# The --ema_* flags and their declared defaults: one given with another value without --use_ema would change nothing.
EMA_FLAG_DEFAULTS = {spec.name: spec.default for spec in flag_specs(EmaFlags) if spec.name != "use_ema"}


def ema_options_from_args(ns: argparse.Namespace) -> EmaOptions:
    """EmaOptions; the --ema_* flags are refused without --use_ema."""
    if not ns.use_ema:
        for name, default in EMA_FLAG_DEFAULTS.items():
            if getattr(ns, name) != default:
                raise ConfigError(f"--{name}: only used with --use_ema; add --use_ema or drop the flag")
        return EmaOptions()
    return EmaOptions(use_ema=True, decay=ns.ema_decay, warmup=not ns.ema_no_warmup,
                      update_every=ns.ema_update_every, device=ns.ema_device, start_step=ns.ema_start_step,
                      save_ema_only=ns.save_ema_only, for_sampling=ns.ema_for_sampling,
                      for_validation=ns.ema_for_validation)
