"""Model configurations of HunyuanImage 2.1: the full-size one (random:hunyuan_image), the tiny test one, and building
them.

HunyuanImage 2.1 (Tencent) is a 17B DiT (diffusers' HunyuanImageTransformer2DModel: 20 double-stream and 40
single-stream blocks, 28 heads of 128, 64 latent channels in 1x1 patches, a 2-block token refiner on the text), fed
by Qwen2.5-VL-7B's language model (the third-to-last hidden states, 3584 wide) and by a glyph byT5-small encoder
(1472 wide, quoted text only), with its own 32x-down VAE (AutoencoderKLHunyuanImage, 64 latent channels). The tiny
preset keeps every class and the refiner depth; widths and depths shrink. Its Qwen tokenizer is local (byte-level BPE
with Qwen's chat markers); the byT5 tokenizer is the real one (bytes need no files) with the 1126 colour and font
tokens sd-scripts adds to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.families.common.qwen_vl import QWEN_REAL_VOCAB_SIZE, build_qwen_tokenizer, qwen_config
from library.families.common.tiny import build_seeded
from library.families.common.diffusers_import import diffusers_classes

LATENT_CHANNELS = 64
VAE_SCALE_FACTOR = 32
LATENT_SCALING_FACTOR = 0.75289  # sd-scripts' hunyuan_image_vae.LATENT_SCALING_FACTOR
PRESET_SEED = 20250909
BYT5_REAL_VOCAB_SIZE = 384  # google/byt5-small before the glyph tokens
# The glyph byT5's extra tokens, in sd-scripts' order (Glyph-SDXL-v2): 138 colours, then the fonts of each language
# numbered from 0.
GLYPH_COLORS = 138
GLYPH_FONTS = (("en", 512), ("cn", 143), ("jp", 211), ("kr", 122))


@dataclass(frozen=True)
class HunyuanImagePreset:
    """A built-in HunyuanImage 2.1 model: the sizes of every part."""

    name: str
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    rope_axes: tuple[int, int]
    qwen_hidden: int
    qwen_intermediate: int
    qwen_layers: int
    qwen_heads: int
    qwen_kv_heads: int
    mrope_section: tuple[int, int, int]
    byt5_d_model: int
    byt5_d_ff: int
    byt5_d_kv: int
    byt5_heads: int
    byt5_layers: int
    vae_channels: tuple[int, ...]
    vae_layers_per_block: int
    qwen_vocab: int | None = None  # None: the local tokenizer's vocabulary


PRESETS: dict[str, HunyuanImagePreset] = {
    "tiny:hunyuan_image": HunyuanImagePreset(
        "tiny:hunyuan_image", double_blocks=2, single_blocks=4, heads=2, head_dim=16, rope_axes=(8, 8),
        qwen_hidden=32, qwen_intermediate=64, qwen_layers=4, qwen_heads=2, qwen_kv_heads=1, mrope_section=(2, 3, 3),
        byt5_d_model=32, byt5_d_ff=64, byt5_d_kv=8, byt5_heads=2, byt5_layers=2,
        vae_channels=(32, 32, 64, 64, 128, 128), vae_layers_per_block=1),
    # tencent/HunyuanImage-2.1 (dit/hunyuanimage2.1.safetensors), Qwen2.5-VL-7B-Instruct, byt5-small (glyph).
    "random:hunyuan_image": HunyuanImagePreset(
        "random:hunyuan_image", double_blocks=20, single_blocks=40, heads=28, head_dim=128, rope_axes=(64, 64),
        qwen_hidden=3584, qwen_intermediate=18944, qwen_layers=28, qwen_heads=28, qwen_kv_heads=4,
        mrope_section=(16, 24, 24), byt5_d_model=1472, byt5_d_ff=3584, byt5_d_kv=64, byt5_heads=6, byt5_layers=12,
        vae_channels=(128, 256, 512, 512, 1024, 1024), vae_layers_per_block=2, qwen_vocab=QWEN_REAL_VOCAB_SIZE),
}


def transformer_config(p: HunyuanImagePreset) -> dict:
    """Keyword arguments of diffusers' HunyuanImageTransformer2DModel for a preset (the 2.1 base model's shape)."""
    return dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=p.heads,
                attention_head_dim=p.head_dim, num_layers=p.double_blocks, num_single_layers=p.single_blocks,
                num_refiner_layers=2, mlp_ratio=4.0, patch_size=(1, 1), qk_norm="rms_norm", guidance_embeds=False,
                text_embed_dim=p.qwen_hidden, text_embed_2_dim=p.byt5_d_model, rope_theta=256.0,
                rope_axes_dim=tuple(p.rope_axes), use_meanflow=False)


def vae_config(channels: tuple[int, ...], layers_per_block: int) -> dict:
    """Keyword arguments of diffusers' AutoencoderKLHunyuanImage (32x down, 64 latent channels)."""
    return dict(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=tuple(channels),
                layers_per_block=layers_per_block, spatial_compression_ratio=VAE_SCALE_FACTOR, sample_size=384,
                scaling_factor=LATENT_SCALING_FACTOR)


def byt5_config(d_model: int, d_ff: int, d_kv: int, heads: int, layers: int, vocab: int):
    """transformers.T5Config of byt5-small's shape (gated GELU) at the given sizes."""
    from transformers import T5Config

    return T5Config(vocab_size=vocab, d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_heads=heads, num_layers=layers,
                    num_decoder_layers=layers, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
                    relative_attention_num_buckets=32, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
                    tie_word_embeddings=False)


def glyph_tokens() -> list[str]:
    """The colour and font tokens sd-scripts (Glyph-SDXL-v2) adds to the byT5 tokenizer, in its order."""
    colors = [f"<color-{i}>" for i in range(GLYPH_COLORS)]
    fonts = [f"<{lang}-font-{i}>" for lang, count in GLYPH_FONTS for i in range(count)]
    return colors + fonts


def build_byt5_tokenizer():
    """google/byt5-small's tokenizer (it needs no vocabulary file) with the glyph tokens added as sd-scripts does."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    tokenizer.add_tokens(glyph_tokens(), special_tokens=True)
    return tokenizer


def build_hunyuan_image_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """DiT, VAE, Qwen2.5-VL text model, byT5 encoder and both tokenizers of a preset.

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a fixed seed,
    identical on every call. Returns {"transformer", "vae", "qwen", "byt5", "qwen_tokenizer", "byt5_tokenizer"}.
    """
    AutoencoderKLHunyuanImage, HunyuanImageTransformer2DModel = diffusers_classes(
        "AutoencoderKLHunyuanImage", "HunyuanImageTransformer2DModel")
    from transformers import Qwen2_5_VLTextModel, T5EncoderModel

    p = PRESETS[name]
    qwen_tokenizer, byt5_tokenizer = build_qwen_tokenizer(), build_byt5_tokenizer()
    qwen_cfg = qwen_config(p.qwen_hidden, p.qwen_intermediate, p.qwen_layers, p.qwen_heads, p.qwen_kv_heads,
                           p.qwen_vocab or len(qwen_tokenizer), p.mrope_section)
    byt5_cfg = byt5_config(p.byt5_d_model, p.byt5_d_ff, p.byt5_d_kv, p.byt5_heads, p.byt5_layers, len(byt5_tokenizer))

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    transformer = make(0, lambda: HunyuanImageTransformer2DModel(**transformer_config(p)))
    vae = make(1, lambda: AutoencoderKLHunyuanImage(**vae_config(p.vae_channels, p.vae_layers_per_block)))
    qwen = make(2, lambda: Qwen2_5_VLTextModel(qwen_cfg))
    byt5 = make(3, lambda: T5EncoderModel(byt5_cfg))
    for module in (transformer, vae, qwen, byt5):
        module.eval()
    return {"transformer": transformer, "vae": vae, "qwen": qwen, "byt5": byt5, "qwen_tokenizer": qwen_tokenizer,
            "byt5_tokenizer": byt5_tokenizer}
