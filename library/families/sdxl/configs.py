"""Model configurations of SDXL: the real full-size one, the tiny test one, and building them.

The tiny preset keeps SDXL's topology (three UNet levels with 0 / 2 / 10
transformer layers per attention, 12 CLIP-L layers, 32 OpenCLIP-bigG layers,
text_time conditioning) so LoRA key names and module counts equal the real
model's; only widths shrink. Attention heads are always 64 channels wide (at
least one head), the rule the single-file loader also uses, so a tiny model
written in the SGM layout loads back as exactly the tiny architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from library.families.common.configs import NORM_GROUPS, REAL_VOCAB_SIZE, text_heads, vae_config
from library.families.common.tiny import build_seeded, build_tokenizer
from library.families.common.configs import te1_config, te2_config
from library.families.common.diffusers_import import diffusers_classes

HEAD_CHANNELS = 64
SDXL_DOWN_BLOCKS = ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
SDXL_UP_BLOCKS = ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")
SDXL_TRANSFORMER_LAYERS = (1, 2, 10)
SDXL_LAYERS_PER_BLOCK = 2
TE1_LAYERS = 12
TE2_LAYERS = 32  # diffusers keeps all of OpenCLIP-bigG's layers (SDXL uses the penultimate output)
TIME_IDS = 6  # original size (h, w), crop top-left (top, left), target size (h, w)
PRESET_SEED = 20240602


def unet_heads(block_out_channels: tuple[int, ...]) -> list[int]:
    """diffusers `attention_head_dim` (a head count per level): 64-channel heads, at least one."""
    return [max(1, c // HEAD_CHANNELS) for c in block_out_channels]


def sdxl_unet_config(block_out_channels: tuple[int, ...], cross_attention_dim: int, pooled_dim: int,
                     addition_time_embed_dim: int, *, transformer_layers: tuple[int, ...] = SDXL_TRANSFORMER_LAYERS,
                     layers_per_block: int = SDXL_LAYERS_PER_BLOCK, in_channels: int = 4,
                     sample_size: int = 128) -> dict:
    """Keyword arguments of `UNet2DConditionModel` for an SDXL UNet (text_time added conditioning)."""
    return dict(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=4,
        down_block_types=SDXL_DOWN_BLOCKS,
        up_block_types=SDXL_UP_BLOCKS,
        block_out_channels=tuple(block_out_channels),
        layers_per_block=layers_per_block,
        transformer_layers_per_block=list(transformer_layers),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=unet_heads(tuple(block_out_channels)),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        projection_class_embeddings_input_dim=pooled_dim + TIME_IDS * addition_time_embed_dim,
        norm_num_groups=NORM_GROUPS,
    )


@dataclass(frozen=True)
class SDXLPreset:
    """A built-in SDXL model: widths of every part."""

    name: str
    unet_channels: tuple[int, ...]
    vae_channels: tuple[int, ...]
    te1_hidden: int
    te1_intermediate: int
    te2_hidden: int
    te2_intermediate: int
    projection_dim: int
    time_embed_dim: int  # addition_time_embed_dim
    vocab_size: Optional[int] = None  # None: the local tokenizer's vocabulary
    sample_size: int = 128


PRESETS: dict[str, SDXLPreset] = {
    "tiny:sdxl": SDXLPreset("tiny:sdxl", (32, 64, 96), (32, 64, 128, 128), 32, 64, 64, 128, 64, 8,
                            sample_size=32),
    "random:sdxl": SDXLPreset("random:sdxl", (320, 640, 1280), (128, 256, 512, 512), 768, 3072, 1280, 5120, 1280,
                              256, REAL_VOCAB_SIZE),
}


def build_sdxl_modules(name: str, device: str | torch.device = "cpu") -> dict[str, nn.Module]:
    """UNet, VAE, both text encoders and tokenizers of a preset ("tiny:sdxl" or "random:sdxl").

    On device "meta" nothing is allocated (for counting modules); otherwise the
    weights are random from a fixed seed, identical on every call. Returns
    {"unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"}.
    """
    AutoencoderKL, UNet2DConditionModel = diffusers_classes("AutoencoderKL", "UNet2DConditionModel")
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection


    p = PRESETS[name]
    tok1, tok2 = build_tokenizer(False), build_tokenizer(True)  # SDXL's second tokenizer pads with "!"
    c1 = CLIPTextConfig(**te1_config(hidden_size=p.te1_hidden, intermediate_size=p.te1_intermediate,
                                     num_hidden_layers=TE1_LAYERS, vocab_size=p.vocab_size or len(tok1), tokenizer=tok1))
    c2 = CLIPTextConfig(**te2_config(hidden_size=p.te2_hidden, intermediate_size=p.te2_intermediate,
                                     num_hidden_layers=TE2_LAYERS, vocab_size=p.vocab_size or len(tok2),
                                     projection_dim=p.projection_dim, tokenizer=tok2))
    unet_kwargs = sdxl_unet_config(p.unet_channels, p.te1_hidden + p.te2_hidden, p.projection_dim, p.time_embed_dim,
                                   sample_size=p.sample_size)
    vae_kwargs = vae_config(p.vae_channels, sample_size=p.sample_size * 8)

    def make(index: int, factory) -> nn.Module:
        return build_seeded(factory, PRESET_SEED + index, device)

    parts = {
        "unet": make(0, lambda: UNet2DConditionModel(**unet_kwargs)),
        "vae": make(1, lambda: AutoencoderKL(**vae_kwargs)),
        "text_encoder": make(2, lambda: CLIPTextModel(c1)),
        "text_encoder_2": make(3, lambda: CLIPTextModelWithProjection(c2)),
    }
    for module in parts.values():
        module.eval()
    return {**parts, "tokenizer": tok1, "tokenizer_2": tok2}


__all__ = ["PRESETS", "SDXLPreset", "build_sdxl_modules", "sdxl_unet_config", "te1_config", "te2_config",
           "text_heads", "unet_heads"]
