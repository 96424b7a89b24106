"""Component configs shared by several families: CLIP text encoders and the SD-style autoencoder."""

from __future__ import annotations

# Group norms use 32 groups in every SD model; the tiny widths are multiples of 32
# so nothing about normalisation has to be guessed when loading a single file.
NORM_GROUPS = 32
# Both CLIP-L (SD1) and OpenCLIP-H (SD2) use 64-channel attention heads, and so do
# the SD2 UNet's attentions; SD1's UNet uses 8 heads whatever the width.
HEAD_CHANNELS = 64
MAX_POSITIONS = 77


def text_heads(hidden_size: int) -> int:
    """Attention heads of a CLIP text encoder of this width (64 channels per head)."""
    return max(1, hidden_size // HEAD_CHANNELS)


def vae_config(block_out_channels: tuple[int, ...], *, layers_per_block: int = 2, latent_channels: int = 4,
               sample_size: int = 512) -> dict:
    """Keyword arguments of `AutoencoderKL`; each block after the first halves the resolution."""
    n = len(block_out_channels)
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(block_out_channels),
        layers_per_block=layers_per_block,
        latent_channels=latent_channels,
        norm_num_groups=NORM_GROUPS,
        sample_size=sample_size,
    )


def text_encoder_config(v2: bool, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                        vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int,
                        max_position_embeddings: int = MAX_POSITIONS) -> dict:
    """Keyword arguments of `transformers.CLIPTextConfig` for CLIP-L (SD1) or OpenCLIP-H (SD2)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=text_heads(hidden_size),
        max_position_embeddings=max_position_embeddings,
        hidden_act="gelu" if v2 else "quick_gelu",
        projection_dim=512 if v2 else 768,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


REAL_VOCAB_SIZE = 49408


def te1_config(*, hidden_size: int, intermediate_size: int, num_hidden_layers: int, vocab_size: int,
               tokenizer, max_position_embeddings: int = 77) -> dict:
    """CLIPTextConfig kwargs of SDXL's first encoder (CLIP-L: quick_gelu)."""
    return text_encoder_config(False, hidden_size=hidden_size, intermediate_size=intermediate_size,
                               num_hidden_layers=num_hidden_layers, vocab_size=vocab_size,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, max_position_embeddings=max_position_embeddings)


def te2_config(*, hidden_size: int, intermediate_size: int, num_hidden_layers: int, vocab_size: int,
               projection_dim: int, tokenizer, max_position_embeddings: int = 77) -> dict:
    """CLIPTextConfig kwargs of SDXL's second encoder (OpenCLIP-bigG: gelu, with a text projection)."""
    kwargs = text_encoder_config(True, hidden_size=hidden_size, intermediate_size=intermediate_size,
                                 num_hidden_layers=num_hidden_layers, vocab_size=vocab_size,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, max_position_embeddings=max_position_embeddings)
    kwargs["projection_dim"] = projection_dim
    return kwargs


