"""Model configurations of Lumina Image 2.0: the full-size one (random:lumina2), the tiny test one, and building them.

Lumina Image 2.0 is Alpha-VLLM's NextDiT 2B (diffusers' Lumina2Transformer2DModel: 26 joint blocks, 2 noise and
2 context refiner blocks, grouped-query attention 24 / 8 heads, 2304 wide), conditioned on Gemma-2 2B's
second-to-last hidden states (transformers' Gemma2Model), with the 16-channel FLUX.1 autoencoder. The tiny preset
keeps every class, the refiner depth and Gemma-2's layer count (26), so LoRA names and counts of the text encoder
equal the real model's; widths and the main depth shrink. Its tokenizer is local: byte-level BPE in Gemma's shape
(<bos> first, <pad> id 0, right padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.families.common.autoencoder import flux_vae_config
from library.families.common.tiny import build_seeded, draw_zero_parameters, seeded, tiny_byte_level_bpe
from library.families.common.diffusers_import import diffusers_classes

LATENT_CHANNELS = 16
PRESET_SEED = 20240617
GEMMA2_REAL_VOCAB_SIZE = 256000
GEMMA2_LAYERS = 26
GEMMA2_TOKENIZER_REPO = "google/gemma-2-2b"  # the tokenizer sd-scripts' strategy_lumina.py uses
PAD_TOKEN, EOS_TOKEN, BOS_TOKEN = "<pad>", "<eos>", "<bos>"  # ids 0, 1, 2 as in Gemma's vocabulary
# The (unused) `norm_final.weight` RMSNorm of the original NextDiT file; sd-scripts' model has it, diffusers not.
UNUSED_NORM_KEY = "norm_final.weight"


@dataclass(frozen=True)
class LuminaPreset:
    """A built-in Lumina Image 2.0 model: the sizes of every part."""

    name: str
    layers: int
    refiner_layers: int
    hidden: int
    heads: int
    kv_heads: int
    axes_dims: tuple[int, int, int]
    multiple_of: int
    gemma_hidden: int
    gemma_intermediate: int
    gemma_heads: int
    gemma_kv_heads: int
    gemma_head_dim: int
    vae_channels: tuple[int, ...]
    gemma_vocab: int | None = None  # None: the local tokenizer's vocabulary


PRESETS: dict[str, LuminaPreset] = {
    "tiny:lumina": LuminaPreset("tiny:lumina", layers=3, refiner_layers=2, hidden=48, heads=2, kv_heads=1,
                                axes_dims=(8, 8, 8), multiple_of=16, gemma_hidden=32, gemma_intermediate=64,
                                gemma_heads=2, gemma_kv_heads=1, gemma_head_dim=16, vae_channels=(32, 32, 64, 64)),
    # sd-scripts' LuminaParams.get_2b_config and its GEMMA2_CONFIG (google/gemma-2-2b).
    "random:lumina2": LuminaPreset("random:lumina2", layers=26, refiner_layers=2, hidden=2304, heads=24, kv_heads=8,
                                   axes_dims=(32, 32, 32), multiple_of=256, gemma_hidden=2304,
                                   gemma_intermediate=9216, gemma_heads=8, gemma_kv_heads=4, gemma_head_dim=256,
                                   vae_channels=(128, 256, 512, 512), gemma_vocab=GEMMA2_REAL_VOCAB_SIZE),
}


def transformer_config(p: LuminaPreset) -> dict:
    """Keyword arguments of diffusers' Lumina2Transformer2DModel for a preset."""
    return dict(sample_size=128, patch_size=2, in_channels=LATENT_CHANNELS, hidden_size=p.hidden,
                num_layers=p.layers, num_refiner_layers=p.refiner_layers, num_attention_heads=p.heads,
                num_kv_heads=p.kv_heads, multiple_of=p.multiple_of, ffn_dim_multiplier=None, norm_eps=1e-5,
                scaling_factor=1.0, axes_dim_rope=tuple(p.axes_dims), axes_lens=(300, 512, 512),
                cap_feat_dim=p.gemma_hidden)


def gemma2_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                  vocab: int):
    """transformers.Gemma2Config of gemma-2-2b's shape at the given sizes (soft-capping, sliding window, eps)."""
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim, query_pre_attn_scalar=head_dim, hidden_activation="gelu_pytorch_tanh",
                        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1,
                        bos_token_id=2, use_cache=False, attention_bias=False)


def build_gemma2_tokenizer():
    """A small local tokenizer in Gemma's shape: <pad> 0, <eos> 1, <bos> 2 (prepended), byte-level BPE, right padding."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    core = tiny_byte_level_bpe(before=[PAD_TOKEN, EOS_TOKEN, BOS_TOKEN])
    core.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B",
                                                        special_tokens=[(BOS_TOKEN, 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                        pad_token=PAD_TOKEN, model_max_length=8192)
    tokenizer.padding_side = "right"
    return tokenizer


def gemma2_shape(p: LuminaPreset) -> dict:
    return dict(hidden=p.gemma_hidden, intermediate=p.gemma_intermediate, layers=GEMMA2_LAYERS, heads=p.gemma_heads,
                kv_heads=p.gemma_kv_heads, head_dim=p.gemma_head_dim)


def build_lumina_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """DiT, AE, Gemma-2 and its tokenizer of a preset ("tiny:lumina", "random:lumina2").

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a fixed seed,
    identical on every call. Returns {"transformer", "vae", "text_encoder", "tokenizer"}.
    """
    AutoencoderKL, Lumina2Transformer2DModel = diffusers_classes("AutoencoderKL", "Lumina2Transformer2DModel")
    from transformers import Gemma2Model

    p = PRESETS[name]
    tokenizer = build_gemma2_tokenizer()
    config = gemma2_config(**gemma2_shape(p), vocab=p.gemma_vocab or len(tokenizer))

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    transformer = make(0, lambda: Lumina2Transformer2DModel(**transformer_config(p)))
    if torch.device(device).type != "meta":
        with seeded(PRESET_SEED + 10):  # NextDiT zero-initialises its AdaLN and final layers
            draw_zero_parameters(transformer)
    vae = make(1, lambda: AutoencoderKL(**flux_vae_config(p.vae_channels)))
    text_encoder = make(2, lambda: Gemma2Model(config))
    for module in (transformer, vae, text_encoder):
        module.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}
