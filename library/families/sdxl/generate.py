"""Image generation for SDXL: both CLIP encoders, weighted prompts, size ids, and the shared DDPM loop.

The denoising loop is SD's (`sd/generate.py` generate_ddpm); SDXL differs only in
its conditioning. Each encoder's penultimate states are weighted by the prompt
weights (`(word:1.2)`) and long prompts are split into 75-token windows as
training does; the pooled embedding comes from encoder 2's first window and is
not weighted. The size ids are original = target = the requested (height,
width) with a (0, 0) crop: an uncropped image of the size asked for.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from library.families.base import Components, ModelFamily, TextConditioning
from library.families.common.clip_text import join_token_chunks, penultimate_states
from library.families.sd.generate import generate_ddpm, resolve_request
from library.families.common.flow_sampling import borrowed_on
from library.sampling.prompt_weighting import (
    apply_token_weights,
    chunk_count,
    tokens_with_weights,
    weighted_windows,
)

# SDXL's native resolution: the size an image gets when neither the prompt nor a flag sets one.
DEFAULT_SIZE = 1024

resolve_sdxl_request = functools.partial(resolve_request, default_size=DEFAULT_SIZE)


@torch.no_grad()
def encode_prompts_sdxl(components: Components, texts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """hidden_state1 (B, n*75+2, D1), hidden_state2 (B, n*75+2, D2), pool2 (B, P): weighted, chunked."""
    lengths = [len(tokens_with_weights(tok, t)[0]) for tok in components.tokenizers for t in texts]
    window = components.tokenizers[0].model_max_length
    n_chunks = chunk_count(lengths, window - 2)  # one window count for both encoders keeps the states aligned
    return encode_weighted_sdxl(components, texts, n_chunks, device, borrow=borrowed_on)


def encode_weighted_sdxl(components: Components, texts: list[str], n_chunks: int, device: torch.device,
                         borrow=None) -> dict[str, torch.Tensor]:
    """The weighted conditioning of `texts` ("(word:1.2)" syntax) in `n_chunks` windows, with gradients when the
    text encoders train (--weighted_captions in training; sampling wraps it without). `borrow(encoder, device)`:
    a context that brings one encoder to the device while it runs (sampling)."""
    window = components.tokenizers[0].model_max_length
    out: dict[str, torch.Tensor] = {}
    batch = len(texts)
    for key, tokenizer, encoder in zip(("hidden_state1", "hidden_state2"), components.tokenizers,
                                       components.text_encoders):
        ids, weights = weighted_windows(tokenizer, texts, n_chunks)
        with borrow(encoder, device) if borrow else contextlib.nullcontext():
            states, full = penultimate_states(encoder, ids.to(device), window)
        joined = join_token_chunks(states.reshape(batch, -1, states.shape[-1]), window)
        out[key] = apply_token_weights(joined, weights.to(joined.device))
        if key == "hidden_state2":
            pooled = full.text_embeds
            out["pool2"] = pooled.reshape(batch, -1, pooled.shape[-1])[:, 0]  # first window, as training does
    return out


def size_ids(rows: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """The batch entries `SDXLFamily.predict` builds its time ids from: uncropped, original = target."""
    hw = torch.tensor([[height, width]] * rows, dtype=torch.long)
    return {"original_sizes_hw": hw, "crop_top_lefts": torch.zeros_like(hw), "target_sizes_hw": hw.clone()}


@torch.no_grad()
def generate_sdxl(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler (SDXL defaults: 1024 px)."""
    def condition(texts: list[str], first) -> tuple[TextConditioning, dict]:
        text = TextConditioning(tensors=encode_prompts_sdxl(components, texts, device))
        return text, size_ids(len(texts), first.height, first.width)

    return generate_ddpm(family, components, requests, device, resolve_sdxl_request, condition)
