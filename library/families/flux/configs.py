"""Model configurations of FLUX.1: the full-size dev/schnell ones, the tiny test one, and building them.

The tiny preset keeps FLUX.1's topology classes (FluxTransformer2DModel with
double- and single-stream blocks and the guidance embedder, a 16-channel
AutoencoderKL without quant convs, CLIP-L with 12 layers, a gated-GELU T5
encoder with 24 blocks) so text-encoder LoRA names and counts equal the real
model's; the transformer has 2 double and 3 single blocks and every width shrinks.
Tokenizers are local: the tiny CLIP one from common/tiny.py and a small T5 Unigram
tokenizer built here (pad 0, eos 1, unk 2, as T5's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from library.families.common.configs import REAL_VOCAB_SIZE, text_encoder_config
from library.families.common.tiny import build_seeded, build_tokenizer
from library.families.common.t5 import T5_REAL_VOCAB_SIZE, build_t5_tokenizer, t5_config
from library.families.common.autoencoder import flux_vae_config
from library.families.common.autoencoder import LATENT_CHANNELS
from library.families.common.diffusers_import import diffusers_classes

PRESET_SEED = 20240603


@dataclass(frozen=True)
class FluxPreset:
    """A built-in FLUX.1 model: sizes of every part."""

    name: str
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, int, int]
    guidance_embeds: bool
    vae_channels: tuple[int, ...]
    clip_hidden: int
    clip_intermediate: int
    t5_d_model: int
    t5_d_ff: int
    t5_heads: int
    t5_d_kv: int
    clip_vocab: int | None = None  # None: the local tokenizer's vocabulary
    t5_vocab: int | None = None


_FULL = dict(double_blocks=19, single_blocks=38, heads=24, head_dim=128, axes_dims_rope=(16, 56, 56),
             vae_channels=(128, 256, 512, 512), clip_hidden=768, clip_intermediate=3072, t5_d_model=4096,
             t5_d_ff=10240, t5_heads=64, t5_d_kv=64, clip_vocab=REAL_VOCAB_SIZE, t5_vocab=T5_REAL_VOCAB_SIZE)
PRESETS: dict[str, FluxPreset] = {
    "tiny:flux": FluxPreset("tiny:flux", 2, 3, 2, 16, (4, 6, 6), True, (32, 32, 64, 64), 32, 64, 32, 64, 2, 16),
    # FLUX.1 Kontext [dev] has FLUX.1 dev's topology: the reference image is extra tokens, not extra weights.
    "tiny:flux_kontext": FluxPreset("tiny:flux_kontext", 2, 3, 2, 16, (4, 6, 6), True, (32, 32, 64, 64), 32, 64, 32,
                                    64, 2, 16),
    "random:flux-dev": FluxPreset("random:flux-dev", guidance_embeds=True, **_FULL),
    "random:flux-schnell": FluxPreset("random:flux-schnell", guidance_embeds=False, **_FULL),
}
CLIP_LAYERS = 12


def transformer_config(p: FluxPreset) -> dict:
    """Keyword arguments of diffusers' FluxTransformer2DModel for a preset."""
    return dict(patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=p.double_blocks,
                num_single_layers=p.single_blocks, attention_head_dim=p.head_dim, num_attention_heads=p.heads,
                joint_attention_dim=p.t5_d_model, pooled_projection_dim=p.clip_hidden,
                guidance_embeds=p.guidance_embeds, axes_dims_rope=tuple(p.axes_dims_rope))


def build_flux_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """Transformer, VAE, CLIP-L, T5 and both tokenizers of a preset ("tiny:flux", "random:flux-dev", ...).

    On device "meta" nothing is allocated (for counting modules); otherwise the
    weights are random from a fixed seed, identical on every call. Returns
    {"transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"}.
    """
    AutoencoderKL, FluxTransformer2DModel = diffusers_classes("AutoencoderKL", "FluxTransformer2DModel")
    from transformers import CLIPTextConfig, CLIPTextModel, T5EncoderModel


    p = PRESETS[name]
    clip_tok, t5_tok = build_tokenizer(False), build_t5_tokenizer()
    clip_cfg = CLIPTextConfig(**text_encoder_config(
        False, hidden_size=p.clip_hidden, intermediate_size=p.clip_intermediate, num_hidden_layers=CLIP_LAYERS,
        vocab_size=p.clip_vocab or len(clip_tok), bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id))
    t5_cfg = t5_config(p, p.t5_vocab or len(t5_tok))

    def make(index: int, factory) -> nn.Module:
        return build_seeded(factory, PRESET_SEED + index, device)

    parts = {
        "transformer": make(0, lambda: FluxTransformer2DModel(**transformer_config(p))),
        "vae": make(1, lambda: AutoencoderKL(**flux_vae_config(p.vae_channels))),
        "text_encoder": make(2, lambda: CLIPTextModel(clip_cfg)),
        "text_encoder_2": make(3, lambda: T5EncoderModel(t5_cfg)),
    }
    for module in parts.values():
        module.eval()
    return {**parts, "tokenizer": clip_tok, "tokenizer_2": t5_tok}

