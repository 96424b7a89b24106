"""CLIP text encoding shared by the SD, SDXL and FLUX.1 families: 75-token chunks, clip_skip, kohya TE names."""

from __future__ import annotations

from typing import Any, Optional

import torch

from library.core.errors import ConfigError

ALLOWED_MAX_TOKEN_LENGTHS = (None, 75, 150, 225)


TEXT_ENCODER_TARGETS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")


def check_max_token_length(max_token_length: Optional[int]) -> int:
    """Validate --max_token_length and return the number of prompt tokens (75, 150 or 225)."""
    if max_token_length not in ALLOWED_MAX_TOKEN_LENGTHS:
        raise ConfigError(f"--max_token_length: expected 75, 150 or 225 (or unset), got {max_token_length!r}")
    return max_token_length or 75


def chunk_token_ids(tokenizer, captions: list[str], max_token_length: Optional[int]) -> torch.Tensor:
    """Tokenise captions into (B, n_chunks * 77) ids: n_chunks = max_token_length / 75 windows.

    Each window is BOS + 75 ids + EOS. With a tokenizer that pads with its own
    token (SD2), a window that ends mid-text gets EOS as its last id and a window
    that is only padding starts with BOS EOS, as in sd-scripts.
    """
    n_tokens = check_max_token_length(max_token_length)
    window = tokenizer.model_max_length  # 77
    inner = window - 2
    ids = tokenizer(captions, padding="max_length", truncation=True, max_length=n_tokens + 2,
                    return_tensors="pt").input_ids
    if n_tokens == inner:
        return ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks = []
    for start in range(1, n_tokens + 1, inner):
        chunk = torch.cat([ids[:, :1], ids[:, start:start + inner], ids[:, -1:]], dim=1)
        if pad != eos:
            ends_mid_text = (chunk[:, -2] != eos) & (chunk[:, -2] != pad)
            chunk[ends_mid_text, -1] = eos
            chunk[chunk[:, 1] == pad, 1] = eos
        chunks.append(chunk)
    return torch.cat(chunks, dim=1)


def final_layer_norm(text_encoder):
    """The final LayerNorm of a CLIPTextModel (transformers 5 dropped the `text_model` level)."""
    inner = getattr(text_encoder, "text_model", text_encoder)
    return inner.final_layer_norm


def text_encoder_kohya_path(path: str) -> str:
    """Module path as kohya names it: always under `text_model.` (lora_te_text_model_encoder_...)."""
    return path if path.startswith("text_model.") else "text_model." + path


def encode_token_chunks(text_encoder, tokens: torch.Tensor, clip_skip: Optional[int],
                        window: int = 77) -> torch.Tensor:
    """Encode (B, n*77) ids chunk by chunk; return (B, n*75 + 2, D) hidden states.

    clip_skip k > 1 takes the k-th hidden state from the end and applies the final
    layer norm (for SD2 too, as sd-scripts does).
    """
    batch = tokens.shape[0]
    flat = tokens.reshape(-1, window).to(text_encoder.device)
    if clip_skip is None or clip_skip <= 1:
        states = text_encoder(flat)[0]
    else:
        out = text_encoder(flat, output_hidden_states=True, return_dict=True)
        states = final_layer_norm(text_encoder)(out.hidden_states[-clip_skip])
    return join_token_chunks(states.reshape(batch, -1, states.shape[-1]), window)


def join_token_chunks(states: torch.Tensor, window: int = 77) -> torch.Tensor:
    """(B, n*77, D) per-chunk states -> (B, n*75 + 2, D): BOS of the first chunk, inner states, EOS of the last."""
    n_chunks = states.shape[1] // window
    if n_chunks == 1:
        return states
    # BOS state of the first chunk, the inner states of every chunk, EOS state of the last.
    parts = [states[:, :1]]
    for c in range(n_chunks):
        parts.append(states[:, c * window + 1:(c + 1) * window - 1])
    parts.append(states[:, -1:])
    return torch.cat(parts, dim=1)



def penultimate_states(text_encoder, tokens: torch.Tensor, window: int) -> tuple[torch.Tensor, Any]:
    """(B*n, 77, D) penultimate-layer states of (B, n*77) ids, and the encoder's full output."""
    out = text_encoder(tokens.reshape(-1, window).to(text_encoder.device), output_hidden_states=True, return_dict=True)
    return out.hidden_states[-2], out

