"""The text-encoder output cache a run trains with (--cache_text_encoder_outputs), built from its settings."""

from __future__ import annotations

from library.data.te_cache import TEXT_OUTPUT_FLAGS, build_text_cache, cache_source_id, final_captions
from library.errors import UserError
from library.train.step import StepContext, encode_captions


def build_step_text_cache(ctx: StepContext, data, settings, opts, trained: frozenset[int],
                          max_train_steps: int) -> frozenset[int]:
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
                               TEXT_OUTPUT_FLAGS + family.text_cache_flags,
                               {**settings.flags, "fp8_base": settings.memory.fp8_text_encoders})
    ctx.text_cache = build_text_cache(
        final_captions(data.samples, data.subsets, max_train_steps),
        lambda captions: encode_captions(ctx, captions, cached if trained else None).tensors,
        model_id=model_id, max_token_length=settings.max_token_length,
        suffix=getattr(family, "text_cache_suffix", None), to_disk=opts.to_disk, batch_size=opts.batch_size)
    return cached
