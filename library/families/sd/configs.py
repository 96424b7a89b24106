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

import torch
from torch import nn

from library.families.common.configs import (
    HEAD_CHANNELS,
    NORM_GROUPS,
    REAL_VOCAB_SIZE,
    text_encoder_config,
    vae_config,
)
from library.families.common.tiny import PRESET_SEED, build_seeded, build_tokenizer
from library.families.common.diffusers_import import diffusers_classes

SD1_UNET_HEADS = 8

SD_DOWN_BLOCKS = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
SD_UP_BLOCKS = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")


def unet_heads(v2: bool, block_out_channels: tuple[int, ...]) -> Any:
    """The diffusers `attention_head_dim` value (a head count, despite the name) for a UNet."""
    if not v2:
        return SD1_UNET_HEADS
    return [max(1, c // HEAD_CHANNELS) for c in block_out_channels]


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


def _text_encoder_kwargs(preset: SDPreset, tokenizer) -> dict:
    return text_encoder_config(
        preset.v2, hidden_size=preset.text_hidden, intermediate_size=preset.text_intermediate,
        num_hidden_layers=preset.text_layers, vocab_size=preset.text_vocab_size or len(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def build_sd_modules(config_name: str, device: str | torch.device = "cpu") -> dict[str, nn.Module]:
    """Build the UNet, VAE, text encoder and tokenizer of a preset ("tiny:sd1", "random:sd15", ...).

    On device "meta" no memory is allocated (for counting parameters and modules);
    otherwise weights are random from a fixed seed, identical on every call.
    Returns {"unet", "vae", "text_encoder", "tokenizer"}.
    """
    AutoencoderKL, UNet2DConditionModel = diffusers_classes("AutoencoderKL", "UNet2DConditionModel")
    from transformers import CLIPTextConfig, CLIPTextModel

    preset = PRESETS[config_name]
    tokenizer = build_tokenizer(preset.v2)
    unet_kwargs = unet_config(preset.v2, preset.unet_channels, preset.text_hidden,
                              sample_size=preset.unet_sample_size)
    vae_kwargs = vae_config(preset.vae_channels, sample_size=preset.unet_sample_size * 8)
    te_config = CLIPTextConfig(**_text_encoder_kwargs(preset, tokenizer))

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    unet = make(0, lambda: UNet2DConditionModel(**unet_kwargs))
    vae = make(1, lambda: AutoencoderKL(**vae_kwargs))
    text_encoder = make(2, lambda: CLIPTextModel(te_config))
    for module in (unet, vae, text_encoder):
        module.eval()
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}


