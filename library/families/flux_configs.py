"""Model configurations of FLUX.1: the full-size dev/schnell ones, the tiny test one, and building them.

The tiny preset keeps FLUX.1's topology classes (FluxTransformer2DModel with
double- and single-stream blocks and the guidance embedder, a 16-channel
AutoencoderKL without quant convs, CLIP-L with 12 layers, a gated-GELU T5
encoder with 24 blocks) so text-encoder LoRA names and counts equal the real
model's; the transformer has 2 double and 3 single blocks and every width shrinks.
Tokenizers are local: the tiny CLIP one from tiny.py and a small T5 Unigram
tokenizer built here (pad 0, eos 1, unk 2, as T5's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from library.families.sd_configs import (
    NORM_GROUPS,
    REAL_VOCAB_SIZE,
    text_encoder_config,
)
from library.families.tiny import build_seeded, build_tokenizer

# The FLUX.1 autoencoder's own latent normalisation (diffusers' vae config of black-forest-labs/FLUX.1-dev).
AE_SCALING_FACTOR = 0.3611
AE_SHIFT_FACTOR = 0.1159
LATENT_CHANNELS = 16
T5_MODEL_MAX_LENGTH = 512
T5_REAL_VOCAB_SIZE = 32128
PRESET_SEED = 20240603
# Words the tiny T5 tokenizer knows whole; anything else is spelled letter by letter.
_T5_WORDS = (
    "the a an of and in on with to at by for photo picture painting portrait landscape man woman girl boy "
    "person dog cat bird house tree flower sky water mountain city street red blue green yellow black white "
    "hair eyes face smiling standing sitting holding wearing dress shirt hat background detailed style"
).split()


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
    "random:flux-dev": FluxPreset("random:flux-dev", guidance_embeds=True, **_FULL),
    "random:flux-schnell": FluxPreset("random:flux-schnell", guidance_embeds=False, **_FULL),
}
CLIP_LAYERS = 12
T5_LAYERS = 24


def transformer_config(p: FluxPreset) -> dict:
    """Keyword arguments of diffusers' FluxTransformer2DModel for a preset."""
    return dict(patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=p.double_blocks,
                num_single_layers=p.single_blocks, attention_head_dim=p.head_dim, num_attention_heads=p.heads,
                joint_attention_dim=p.t5_d_model, pooled_projection_dim=p.clip_hidden,
                guidance_embeds=p.guidance_embeds, axes_dims_rope=tuple(p.axes_dims_rope))


def flux_vae_config(block_out_channels: tuple[int, ...]) -> dict:
    """AutoencoderKL kwargs of the FLUX.1 AE: 16 latent channels, no quant convs, its scale and shift."""
    n = len(block_out_channels)
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_out_channels),
                layers_per_block=2, latent_channels=LATENT_CHANNELS, norm_num_groups=NORM_GROUPS,
                use_quant_conv=False, use_post_quant_conv=False, scaling_factor=AE_SCALING_FACTOR,
                shift_factor=AE_SHIFT_FACTOR)


def t5_config(p: FluxPreset, vocab_size: int):
    """transformers.T5Config of the T5-XXL v1.1 encoder shape (gated GELU) at the preset's widths."""
    from transformers import T5Config

    return T5Config(vocab_size=vocab_size, d_model=p.t5_d_model, d_ff=p.t5_d_ff, d_kv=p.t5_d_kv,
                    num_heads=p.t5_heads, num_layers=T5_LAYERS, feed_forward_proj="gated-gelu",
                    relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    dense_act_fn="gelu_new", is_gated_act=True, tie_word_embeddings=False,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


@functools.lru_cache(maxsize=1)
def _t5_vocab() -> tuple[tuple[str, float], ...]:
    letters = "abcdefghijklmnopqrstuvwxyz0123456789,.!?'-"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    vocab += [("▁" + w, -1.0) for w in _T5_WORDS]
    vocab += [(c, -5.0) for c in letters] + [("▁" + c, -4.0) for c in letters]
    return tuple(vocab)


def build_t5_tokenizer():
    """A small local T5 tokenizer (SentencePiece-style Unigram, lower-cased; appends </s>)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import T5TokenizerFast

    core = Tokenizer(models.Unigram(list(_t5_vocab()), unk_id=2, byte_fallback=False))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    core.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                        special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           extra_ids=0, model_max_length=T5_MODEL_MAX_LENGTH)


def build_flux_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """Transformer, VAE, CLIP-L, T5 and both tokenizers of a preset ("tiny:flux", "random:flux-dev", ...).

    On device "meta" nothing is allocated (for counting modules); otherwise the
    weights are random from a fixed seed, identical on every call. Returns
    {"transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"}.
    """
    from diffusers import AutoencoderKL, FluxTransformer2DModel
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

