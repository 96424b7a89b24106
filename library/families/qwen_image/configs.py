"""Model configurations of Qwen-Image: the full-size one (random:qwen_image), the tiny test one, and building them.

Qwen-Image (Qwen/Qwen-Image) is a 20B MMDiT (diffusers' QwenImageTransformer2DModel: 60 double-stream blocks, 24
heads of 128, 16 latent channels packed in 2x2 patches = 64 inputs), fed by Qwen2.5-VL-7B's language model (its last
hidden states, 3584 wide), with a Wan-2.1-style VAE (AutoencoderKLQwenImage: 8x down, 16 latent channels normalised
per channel by `latents_mean` / `latents_std`). The tiny preset keeps every class; widths and depths shrink. Its Qwen
tokenizer is local (byte-level BPE with Qwen's chat markers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.families.common.qwen_vl import (
    QWEN_REAL_VOCAB_SIZE,
    build_qwen_tokenizer,
    qwen_config,
    tiny_vision_config,
    vl_config,
    vl_processor,
)
from library.families.common.tiny import build_seeded
from library.families.common.diffusers_import import diffusers_classes

LATENT_CHANNELS = 16
VAE_SCALE_FACTOR = 8
PATCH = 2  # latents are packed in 2x2 patches: sizes are multiples of 16 pixels
PRESET_SEED = 20250804
# diffusers' AutoencoderKLQwenImage defaults (Qwen/Qwen-Image vae/config.json)
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916)


@dataclass(frozen=True)
class QwenImagePreset:
    """A built-in Qwen-Image model: the sizes of every part."""

    name: str
    layers: int
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, int, int]
    qwen_hidden: int
    qwen_intermediate: int
    qwen_layers: int
    qwen_heads: int
    qwen_kv_heads: int
    mrope_section: tuple[int, int, int]
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]
    vae_res_blocks: int
    qwen_vocab: int | None = None  # None: the local tokenizer's vocabulary
    vision: bool = False  # Qwen-Image-Edit: Qwen2.5-VL with its vision tower (the control images' text encoding)


PRESETS: dict[str, QwenImagePreset] = {
    "tiny:qwen_image": QwenImagePreset(
        "tiny:qwen_image", layers=2, heads=2, head_dim=16, axes_dims_rope=(4, 6, 6),
        qwen_hidden=32, qwen_intermediate=64, qwen_layers=4, qwen_heads=2, qwen_kv_heads=1, mrope_section=(2, 3, 3),
        vae_base_dim=8, vae_dim_mult=(1, 2, 2, 2), vae_res_blocks=1),
    # Qwen-Image-Edit (-2509 / -2511): the same DiT; Qwen2.5-VL with a tiny vision tower, the tokenizer with Qwen's
    # vision markers (--model_version picks the edit version)
    "tiny:qwen_image_edit": QwenImagePreset(
        "tiny:qwen_image_edit", layers=2, heads=2, head_dim=16, axes_dims_rope=(4, 6, 6),
        qwen_hidden=32, qwen_intermediate=64, qwen_layers=4, qwen_heads=2, qwen_kv_heads=1, mrope_section=(2, 3, 3),
        vae_base_dim=8, vae_dim_mult=(1, 2, 2, 2), vae_res_blocks=1, vision=True),
    # Qwen/Qwen-Image (transformer/), Qwen2.5-VL-7B-Instruct's language model, vae/.
    "random:qwen_image": QwenImagePreset(
        "random:qwen_image", layers=60, heads=24, head_dim=128, axes_dims_rope=(16, 56, 56),
        qwen_hidden=3584, qwen_intermediate=18944, qwen_layers=28, qwen_heads=28, qwen_kv_heads=4,
        mrope_section=(16, 24, 24), vae_base_dim=96, vae_dim_mult=(1, 2, 4, 4), vae_res_blocks=2,
        qwen_vocab=QWEN_REAL_VOCAB_SIZE),
}


def transformer_config(p: QwenImagePreset) -> dict:
    """Keyword arguments of diffusers' QwenImageTransformer2DModel for a preset (Qwen-Image's shape)."""
    return dict(patch_size=PATCH, in_channels=LATENT_CHANNELS * PATCH * PATCH, out_channels=LATENT_CHANNELS,
                num_layers=p.layers, attention_head_dim=p.head_dim, num_attention_heads=p.heads,
                joint_attention_dim=p.qwen_hidden, guidance_embeds=False, axes_dims_rope=tuple(p.axes_dims_rope))


def vae_config(base_dim: int, dim_mult: tuple[int, ...], res_blocks: int) -> dict:
    """Keyword arguments of diffusers' AutoencoderKLQwenImage (8x down, 16 latent channels, Qwen-Image's mean/std)."""
    return dict(base_dim=base_dim, z_dim=LATENT_CHANNELS, dim_mult=list(dim_mult), num_res_blocks=res_blocks,
                attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
                latents_mean=list(LATENTS_MEAN), latents_std=list(LATENTS_STD))


def build_qwen_image_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """DiT, VAE, Qwen2.5-VL text model and tokenizer of a preset.

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a fixed seed,
    identical on every call. Returns {"transformer", "vae", "qwen", "qwen_tokenizer"}; a vision preset's "qwen" is
    the whole Qwen2_5_VLModel (vision tower and language model) and "qwen_processor" its Qwen2VLProcessor.
    """
    AutoencoderKLQwenImage, QwenImageTransformer2DModel = diffusers_classes(
        "AutoencoderKLQwenImage", "QwenImageTransformer2DModel")
    from transformers import Qwen2_5_VLModel, Qwen2_5_VLTextModel

    p = PRESETS[name]
    tokenizer = build_qwen_tokenizer(p.vision)
    qwen_cfg = qwen_config(p.qwen_hidden, p.qwen_intermediate, p.qwen_layers, p.qwen_heads, p.qwen_kv_heads,
                           p.qwen_vocab or len(tokenizer), p.mrope_section)

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    transformer = make(0, lambda: QwenImageTransformer2DModel(**transformer_config(p)))
    vae = make(1, lambda: AutoencoderKLQwenImage(**vae_config(p.vae_base_dim, p.vae_dim_mult, p.vae_res_blocks)))
    if p.vision:
        config = vl_config(qwen_cfg, tiny_vision_config(p.qwen_hidden), tokenizer)
        qwen = make(2, lambda: Qwen2_5_VLModel(config))
    else:
        qwen = make(2, lambda: Qwen2_5_VLTextModel(qwen_cfg))
    for module in (transformer, vae, qwen):
        module.eval()
    parts = {"transformer": transformer, "vae": vae, "qwen": qwen, "qwen_tokenizer": tokenizer}
    if p.vision:
        parts["qwen_processor"] = vl_processor(tokenizer)
    return parts
