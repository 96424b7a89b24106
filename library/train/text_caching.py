"""The text-encoder output cache a run trains with (--cache_text_encoder_outputs), built from its settings."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from library.core.errors import UserError
from library.data.cache_share import CacheShare
from library.data.dataset import TrainingData
from library.data.te_cache import (
    build_text_cache,
    cache_source_id,
    caption_randomness,
    final_captions,
    subset_caption_settings,
)
from library.train.settings import RunSettings
from library.train.speedups import auto_text_cache_blocked
from library.train.step import StepContext, encode_captions

logger = logging.getLogger(__name__)

# The automatic cache holds every distinct caption's outputs in memory; above this it is not used.
AUTO_TEXT_CACHE_MAX_BYTES = 4 << 30


def _text_items(ctx: StepContext, data: TrainingData, max_train_steps: int) -> list[tuple[str, str]]:
    """(image path, text key) of every sample: its final caption, with its control images where the family's text
    encoder reads them (family.text_key; library/train/step.py text_keys)."""
    items = final_captions(data.samples, data.subsets, max_train_steps)
    return [(path, ctx.family.text_key(ctx.components, caption, tuple(sample.control_paths)))
            for (path, caption), sample in zip(items, data.samples)]


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
        _text_items(ctx, data, max_train_steps),
        lambda captions: encode_captions(ctx, captions, cached if trained else None).tensors,
        model_id=model_id, max_token_length=settings.text.max_token_length,
        suffix=family.text_cache_suffix, to_disk=opts.to_disk, batch_size=opts.batch_size, share=share)
    return cached


def start_auto_text_cache(ctx: StepContext, data: TrainingData, settings: RunSettings, trained: frozenset[int],
                          max_train_steps: int) -> bool:
    """Turn on the automatic in-memory cache of the text encoders' outputs when it cannot change the result: no
    text encoder trains and no caption changes between steps. Each caption is encoded the first time a step meets
    it (library/train/step.py fill_text_cache). One log line either way it is decided; returns whether it is on."""
    randomness = [caption_randomness(s) for _, s in subset_caption_settings(data)]
    blocked = auto_text_cache_blocked(settings.speed, settings.text_cache.enabled, bool(trained) or ctx.train_text_encoder,
                                      randomness, len(ctx.components.text_encoders))
    if blocked is None and ctx.weighted_captions:  # refused with the explicit cache too: a caption's chunks follow its batch
        blocked = "--weighted_captions"
    if blocked is None:
        captions = {caption for _, caption in _text_items(ctx, data, max_train_steps)}
        with torch.no_grad():
            probe = encode_captions(ctx, [""]).tensors
        per_caption = sum(v[0].numel() * v.element_size() for v in probe.values())
        if per_caption * len(captions) > AUTO_TEXT_CACHE_MAX_BYTES:
            blocked = (f"{len(captions)} captions would take {per_caption * len(captions) / 2**30:.1f} GiB "
                       f"(over {AUTO_TEXT_CACHE_MAX_BYTES >> 30} GiB)")
    if blocked is not None:
        if blocked not in ("--no_auto_text_cache", "--cache_text_encoder_outputs", "no text encoder",
                           "a text encoder trains"):  # said only when the reason is not the user's own choice
            logger.info("text encoder outputs are computed every step (%s)", blocked)
        return False
    ctx.text_cache, ctx.fill_text_cache = {}, True
    logger.info("text encoders are frozen and captions fixed: each caption's outputs are kept in memory the first "
                "time it is met (%d captions, %.0f MiB; --no_auto_text_cache to encode every step)",
                len(captions), per_caption * len(captions) / 2**20)
    return True
