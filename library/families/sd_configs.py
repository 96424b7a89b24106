"""Model configurations of SD 1.x / 2.x: the real full-size ones and the tiny test ones.

Tiny configs keep the real block topology (block types, layers per block, one
transformer block per attention, 12 / 23 text-encoder layers) so that LoRA key
names and module counts equal the full-size model's; only the widths shrink.

The same rules that the single-file loader uses to infer a config from tensor
shapes (see `unet_heads`, `text_heads`) are used here, so a tiny model saved in
the LDM layout loads back as exactly the tiny architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Group norms use 32 groups in every SD model; the tiny widths are multiples of 32
# so nothing about normalisation has to be guessed when loading a single file.
NORM_GROUPS = 32
# Both CLIP-L (SD1) and OpenCLIP-H (SD2) use 64-channel attention heads, and so do
# the SD2 UNet's attentions; SD1's UNet uses 8 heads whatever the width.
HEAD_CHANNELS = 64
SD1_UNET_HEADS = 8
MAX_POSITIONS = 77

SD_DOWN_BLOCKS = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
SD_UP_BLOCKS = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")


def unet_heads(v2: bool, block_out_channels: tuple[int, ...]) -> Any:
    """The diffusers `attention_head_dim` value (a head count, despite the name) for a UNet."""
    if not v2:
        return SD1_UNET_HEADS
    return [max(1, c // HEAD_CHANNELS) for c in block_out_channels]


def text_heads(hidden_size: int) -> int:
    """Attention heads of a CLIP text encoder of this width (64 channels per head)."""
    return max(1, hidden_size // HEAD_CHANNELS)


def unet_config(v2: bool, block_out_channels: tuple[int, ...], cross_attention_dim: int, *,
                layers_per_block: int = 2, sample_size: int = 64, in_channels: int = 4,
                down_block_types: tuple[str, ...] = SD_DOWN_BLOCKS,
                up_block_types: tuple[str, ...] = SD_UP_BLOCKS) -> dict:
    """Keyword arguments of `UNet2DConditionModel` for an SD1 (v2=False) or SD2 UNet."""
    return dict(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=4,
        down_block_types=tuple(down_block_types),
        up_block_types=tuple(up_block_types),
        block_out_channels=tuple(block_out_channels),
        layers_per_block=layers_per_block,
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=unet_heads(v2, tuple(block_out_channels)),
        use_linear_projection=v2,
        norm_num_groups=NORM_GROUPS,
    )


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


@dataclass(frozen=True)
class SDPreset:
    """A built-in model: configs of the three parts plus how it is trained."""

    name: str
    v2: bool
    v_parameterization: bool
    unet_channels: tuple[int, ...]
    vae_channels: tuple[int, ...]
    text_hidden: int
    text_intermediate: int
    text_layers: int
    # None: the text encoder's vocabulary is exactly the local tokenizer's.
    text_vocab_size: int | None = None
    unet_sample_size: int = 64


SD1_TEXT_LAYERS = 12
# diffusers' SD2 text encoder holds 23 of OpenCLIP-H's 24 layers (SD2 uses the penultimate one).
SD2_TEXT_LAYERS = 23
REAL_VOCAB_SIZE = 49408

_TINY_UNET = (32, 64, 128, 128)  # widths double where the real ones do: same conv_shortcut layout
_TINY_VAE = (32, 64, 128, 128)

PRESETS: dict[str, SDPreset] = {
    "tiny:sd1": SDPreset("tiny:sd1", False, False, _TINY_UNET, _TINY_VAE, 32, 64, SD1_TEXT_LAYERS),
    "tiny:sd2": SDPreset("tiny:sd2", True, False, _TINY_UNET, _TINY_VAE, 32, 64, SD2_TEXT_LAYERS),
    "tiny:sd2-v": SDPreset("tiny:sd2-v", True, True, _TINY_UNET, _TINY_VAE, 32, 64, SD2_TEXT_LAYERS,
                           unet_sample_size=96),
    "random:sd15": SDPreset("random:sd15", False, False, (320, 640, 1280, 1280), (128, 256, 512, 512),
                            768, 3072, SD1_TEXT_LAYERS, REAL_VOCAB_SIZE),
    "random:sd21": SDPreset("random:sd21", True, True, (320, 640, 1280, 1280), (128, 256, 512, 512),
                            1024, 4096, SD2_TEXT_LAYERS, REAL_VOCAB_SIZE, unet_sample_size=96),
    "random:sd21-base": SDPreset("random:sd21-base", True, False, (320, 640, 1280, 1280), (128, 256, 512, 512),
                                 1024, 4096, SD2_TEXT_LAYERS, REAL_VOCAB_SIZE),
}

