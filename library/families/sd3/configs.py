"""Model configurations of SD3 / SD3.5: the full-size medium / 3.5 medium / 3.5 large ones, the tiny test
one, and building them.

Every model is diffusers' SD3Transformer2DModel (MMDiT), CLIP-L and CLIP-G (both
CLIPTextModelWithProjection, as StableDiffusion3Pipeline has them), T5-XXL (T5EncoderModel)
and a 16-channel AutoencoderKL without quant convs. The tiny preset keeps SD3.5 medium's
topology (RMS q/k norms, a second x-block attention in the first block, the last block's
context stream "pre only") and the text encoders' layer counts (12, 32, 24), so LoRA names
and counts per block equal the real model's; widths shrink (attention heads stay 64 wide, as
the single-file layout stores no head count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from library.families.common.t5 import build_t5_tokenizer, t5_config
from library.families.common.configs import NORM_GROUPS, REAL_VOCAB_SIZE
from library.families.common.configs import te1_config, te2_config
from library.families.common.tiny import build_seeded, build_tokenizer
from library.families.common.diffusers_import import diffusers_classes

# The SD3 autoencoder's latent normalisation (diffusers' vae config of stabilityai/stable-diffusion-3-medium-diffusers).
VAE_SCALING_FACTOR = 1.5305
VAE_SHIFT_FACTOR = 0.0609
LATENT_CHANNELS = 16
HEAD_DIM = 64  # every SD3 MMDiT: hidden size = 64 · heads (sd-scripts: depth = hidden // 64)
CLIP_L_LAYERS = 12
CLIP_G_LAYERS = 32
T5_LAYERS = 24
PRESET_SEED = 20240612
T5_REAL_VOCAB_SIZE = 32128


@dataclass(frozen=True)
class SD3Preset:
    """A built-in SD3 model: sizes of every part."""

    name: str
    model_type: str  # sd-scripts' model_type: "medium", "5-medium", "5-large"
    layers: int
    heads: int
    pos_embed_max_size: int
    qk_norm: bool
    dual_attention_layers: tuple[int, ...]
    vae_channels: tuple[int, ...]
    clip_l_hidden: int
    clip_l_intermediate: int
    clip_g_hidden: int
    clip_g_intermediate: int
    t5_d_model: int
    t5_d_ff: int
    t5_heads: int
    t5_d_kv: int
    sample_size: int = 128
    clip_vocab: int | None = None  # None: the local tokenizer's vocabulary
    t5_vocab: int | None = None


_TEXT_FULL = dict(vae_channels=(128, 256, 512, 512), clip_l_hidden=768, clip_l_intermediate=3072, clip_g_hidden=1280,
                  clip_g_intermediate=5120, t5_d_model=4096, t5_d_ff=10240, t5_heads=64, t5_d_kv=64,
                  clip_vocab=REAL_VOCAB_SIZE, t5_vocab=T5_REAL_VOCAB_SIZE)
PRESETS: dict[str, SD3Preset] = {
    "tiny:sd3": SD3Preset("tiny:sd3", "5-medium", layers=3, heads=2, pos_embed_max_size=32, qk_norm=True,
                          dual_attention_layers=(0,), vae_channels=(32, 32, 64, 64), clip_l_hidden=32,
                          clip_l_intermediate=64, clip_g_hidden=64, clip_g_intermediate=128, t5_d_model=32,
                          t5_d_ff=64, t5_heads=2, t5_d_kv=16, sample_size=32),
    "random:sd3-medium": SD3Preset("random:sd3-medium", "medium", layers=24, heads=24, pos_embed_max_size=192,
                                   qk_norm=False, dual_attention_layers=(), **_TEXT_FULL),
    "random:sd3.5-medium": SD3Preset("random:sd3.5-medium", "5-medium", layers=24, heads=24, pos_embed_max_size=384,
                                     qk_norm=True, dual_attention_layers=tuple(range(13)), **_TEXT_FULL),
    "random:sd3.5-large": SD3Preset("random:sd3.5-large", "5-large", layers=38, heads=38, pos_embed_max_size=192,
                                    qk_norm=True, dual_attention_layers=(), **_TEXT_FULL),
}


def transformer_config(p: SD3Preset) -> dict:
    """Keyword arguments of diffusers' SD3Transformer2DModel for a preset."""
    hidden = p.heads * HEAD_DIM
    return dict(sample_size=p.sample_size, patch_size=2, in_channels=LATENT_CHANNELS, num_layers=p.layers,
                attention_head_dim=HEAD_DIM, num_attention_heads=p.heads, joint_attention_dim=p.t5_d_model,
                caption_projection_dim=hidden, pooled_projection_dim=p.clip_l_hidden + p.clip_g_hidden,
                out_channels=LATENT_CHANNELS, pos_embed_max_size=p.pos_embed_max_size,
                dual_attention_layers=tuple(p.dual_attention_layers), qk_norm="rms_norm" if p.qk_norm else None)


def model_type_of(config) -> str:
    """sd-scripts' model_type of a transformer config: "medium" (no q/k norm), "5-medium" (second attention)
    or "5-large" (q/k norm, no second attention)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    if not get("qk_norm", None):
        return "medium"
    return "5-medium" if tuple(get("dual_attention_layers", ()) or ()) else "5-large"


def sd3_vae_config(block_out_channels: tuple[int, ...]) -> dict:
    """AutoencoderKL kwargs of the SD3 VAE: 16 latent channels, no quant convs, its scale and shift."""
    n = len(block_out_channels)
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_out_channels),
                layers_per_block=2, latent_channels=LATENT_CHANNELS, norm_num_groups=NORM_GROUPS,
                use_quant_conv=False, use_post_quant_conv=False, scaling_factor=VAE_SCALING_FACTOR,
                shift_factor=VAE_SHIFT_FACTOR)


def clip_configs(p: SD3Preset, tok_l, tok_g):
    """CLIPTextConfigs of CLIP-L (quick_gelu) and CLIP-G (gelu), each with a text projection of its own width."""
    from transformers import CLIPTextConfig

    c_l = te1_config(hidden_size=p.clip_l_hidden, intermediate_size=p.clip_l_intermediate,
                     num_hidden_layers=CLIP_L_LAYERS, vocab_size=p.clip_vocab or len(tok_l), tokenizer=tok_l)
    c_l["projection_dim"] = p.clip_l_hidden
    c_g = te2_config(hidden_size=p.clip_g_hidden, intermediate_size=p.clip_g_intermediate,
                     num_hidden_layers=CLIP_G_LAYERS, vocab_size=p.clip_vocab or len(tok_g),
                     projection_dim=p.clip_g_hidden, tokenizer=tok_g)
    return CLIPTextConfig(**c_l), CLIPTextConfig(**c_g)


def t5_preset_config(p: SD3Preset, vocab_size: int):
    """T5Config of the preset's T5-XXL encoder shape."""
    return t5_config(p, vocab_size)


def build_sd3_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """Transformer, VAE, CLIP-L, CLIP-G, T5 and the three tokenizers of a preset ("tiny:sd3", "random:sd3-medium", ...).

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a
    fixed seed, identical on every call. The transformer is in diffusers' own layout (see
    sd3/layout.py to_sai_order for what loading does next). Returns {"transformer", "vae", "text_encoder",
    "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"}.
    """
    AutoencoderKL, SD3Transformer2DModel = diffusers_classes("AutoencoderKL", "SD3Transformer2DModel")
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    p = PRESETS[name]
    tok_l, tok_g, tok_t5 = build_tokenizer(False), build_tokenizer(True), build_t5_tokenizer()  # CLIP-G pads with "!"
    c_l, c_g = clip_configs(p, tok_l, tok_g)
    t5_cfg = t5_preset_config(p, p.t5_vocab or len(tok_t5))

    def make(index: int, factory) -> nn.Module:
        return build_seeded(factory, PRESET_SEED + index, device)

    parts = {
        "transformer": make(0, lambda: SD3Transformer2DModel(**transformer_config(p))),
        "vae": make(1, lambda: AutoencoderKL(**sd3_vae_config(p.vae_channels))),
        "text_encoder": make(2, lambda: CLIPTextModelWithProjection(c_l)),
        "text_encoder_2": make(3, lambda: CLIPTextModelWithProjection(c_g)),
        "text_encoder_3": make(4, lambda: T5EncoderModel(t5_cfg)),
    }
    for module in parts.values():
        module.eval()
    return {**parts, "tokenizer": tok_l, "tokenizer_2": tok_g, "tokenizer_3": tok_t5}

