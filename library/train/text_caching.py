"""The text-encoder output cache a run trains with (--cache_text_encoder_outputs), built from its settings."""

from __future__ import annotations

from typing import Optional

from library.core.errors import UserError
from library.data.cache_share import CacheShare
from library.data.dataset import TrainingData
from library.data.te_cache import (
    build_text_cache,
    cache_source_id,
    final_captions,
)
from library.train.settings import RunSettings
from library.train.step import StepContext, encode_captions


def build_step_text_cache(ctx: StepContext, data: TrainingData, settings: RunSettings, trained: frozenset[int],
                          max_train_steps: int, share: Optional[CacheShare] = None) -> frozenset[int]:
    """Fill ctx.text_cache with the outputs of the text encoders that do not train; returns their indices.

    The encoders in `trained` (their LoRA learns) are run every step instead (ctx.live_encoders);
    that split needs a family that says which outputs come from which encoder.
    """
    family, components = ctx.family, ctx.components
    cached = frozenset(range(len(components.text_encoders))) - trained
    if not cached:
        raise UserError("--cache_text_encoder_outputs: every text encoder trains, so there is nothing to cache; "
                        "drop the flag, or train fewer encoders (e.g. --network_train_unet_only)")
    ctx.live_encoders = trained
    model_id = cache_source_id(settings.model.pretrained_model_name_or_path, components.text_encoders[0].dtype,
                               {"fp8_base": settings.memory.fp8_text_encoders,
                                # quantized encoders give other outputs (no key change for no_change)
                                **({"text_encoder_precision": settings.memory.text_encoder_precision}
                                   if settings.memory.text_encoder_precision != "no_change" else {}),
                                **family.text_cache_values(family.options(components))})
    opts = settings.text_cache
    ctx.text_cache = build_text_cache(
        final_captions(data.samples, data.subsets, max_train_steps),
        lambda captions: encode_captions(ctx, captions, cached if trained else None).tensors,
        model_id=model_id, max_token_length=settings.text.max_token_length,
        suffix=family.text_cache_suffix, to_disk=opts.to_disk, batch_size=opts.batch_size, share=share)
    return cached
