"""Model configurations of Z-Image: the full-size one (random:zimage), the tiny test one, and building them.

Z-Image (Tongyi-MAI, Turbo and Base share the architecture) is a single-stream DiT (diffusers'
ZImageTransformer2DModel: 30 main blocks, 2 noise and 2 context refiner blocks, 30 heads of 128, 3840 wide, caption
features 2560 wide), conditioned on Qwen3-4B's second-to-last hidden states (transformers' Qwen3Model), with the
16-channel FLUX.1 autoencoder (diffusers AutoencoderKL, scale 0.3611, shift 0.1159). The tiny preset keeps every
class and the refiner depth; widths and the main depth shrink. Its tokenizer is local: byte-level BPE with Qwen's
chat tokens (<|im_start|>, <|im_end|>, <|endoftext|> as padding, right padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.families.common.qwen3 import preset_qwen3_config
from library.families.common.autoencoder import flux_vae_config
from library.families.common.tiny import build_seeded, draw_zero_parameters, seeded, tiny_byte_level_bpe
from library.families.common.diffusers_import import diffusers_classes

LATENT_CHANNELS = 16
PRESET_SEED = 20251127
QWEN3_REAL_VOCAB_SIZE = 151936
QWEN3_TOKENIZER_REPO = "Qwen/Qwen3-4B"
PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# diffusers' ZImagePipeline: the tokenizer's chat template with add_generation_prompt and enable_thinking=True, which
# for Qwen3 renders exactly this around one user message.
CHAT_TEMPLATE = IM_START + "user\n{}" + IM_END + "\n" + IM_START + "assistant\n"


@dataclass(frozen=True)
class ZImagePreset:
    """A built-in Z-Image model: the sizes of every part."""

    name: str
    layers: int
    refiner_layers: int
    dim: int
    heads: int
    axes_dims: tuple[int, int, int]
    qwen_hidden: int
    qwen_intermediate: int
    qwen_layers: int
    qwen_heads: int
    qwen_kv_heads: int
    qwen_head_dim: int
    vae_channels: tuple[int, ...]
    qwen_vocab: int | None = None  # None: the local tokenizer's vocabulary


PRESETS: dict[str, ZImagePreset] = {
    "tiny:zimage": ZImagePreset("tiny:zimage", layers=2, refiner_layers=2, dim=64, heads=2, axes_dims=(8, 12, 12),
                                qwen_hidden=32, qwen_intermediate=64, qwen_layers=3, qwen_heads=2, qwen_kv_heads=1,
                                qwen_head_dim=16, vae_channels=(32, 32, 64, 64)),
    # Tongyi-MAI/Z-Image-Turbo transformer/config.json and Qwen3-4B's config.
    "random:zimage": ZImagePreset("random:zimage", layers=30, refiner_layers=2, dim=3840, heads=30,
                                  axes_dims=(32, 48, 48), qwen_hidden=2560, qwen_intermediate=9728, qwen_layers=36,
                                  qwen_heads=32, qwen_kv_heads=8, qwen_head_dim=128,
                                  vae_channels=(128, 256, 512, 512), qwen_vocab=QWEN3_REAL_VOCAB_SIZE),
}


def transformer_config(p: ZImagePreset) -> dict:
    """Keyword arguments of diffusers' ZImageTransformer2DModel for a preset."""
    return dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=p.dim,
                n_layers=p.layers, n_refiner_layers=p.refiner_layers, n_heads=p.heads, n_kv_heads=p.heads,
                norm_eps=1e-5, qk_norm=True, cap_feat_dim=p.qwen_hidden, rope_theta=256.0, t_scale=1000.0,
                axes_dims=list(p.axes_dims), axes_lens=[1536, 512, 512])



def build_qwen3_tokenizer():
    """A small local tokenizer in Qwen's shape: byte-level BPE, the chat tokens, <|endoftext|> padding on the right."""
    from transformers import PreTrainedTokenizerFast

    core = tiny_byte_level_bpe(after=[PAD_TOKEN, IM_START, IM_END])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD_TOKEN,
                                        additional_special_tokens=[IM_START, IM_END], model_max_length=40960)
    tokenizer.padding_side = "right"
    # Qwen3's chat template reduced to what ZImagePipeline renders (so the pipeline runs on a written tiny folder)
    tokenizer.chat_template = ("{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END
                               + "\n{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")
    return tokenizer


def build_zimage_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """DiT, AE, Qwen3 and its tokenizer of a preset ("tiny:zimage", "random:zimage").

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a fixed seed,
    identical on every call. Returns {"transformer", "vae", "text_encoder", "tokenizer"}.
    """
    AutoencoderKL, ZImageTransformer2DModel = diffusers_classes("AutoencoderKL", "ZImageTransformer2DModel")
    from transformers import Qwen3Model

    p = PRESETS[name]
    tokenizer = build_qwen3_tokenizer()
    config = preset_qwen3_config(p, tokenizer)

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    transformer = make(0, lambda: ZImageTransformer2DModel(**transformer_config(p)))
    if torch.device(device).type != "meta":
        with seeded(PRESET_SEED + 10):  # zero-initialised tensors (pad tokens, a few biases) drawn too
            draw_zero_parameters(transformer)
    vae = make(1, lambda: AutoencoderKL(**flux_vae_config(p.vae_channels)))
    text_encoder = make(2, lambda: Qwen3Model(config))
    for module in (transformer, vae, text_encoder):
        module.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}
