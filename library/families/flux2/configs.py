"""Model configurations of FLUX.2 klein: the full-size ones (random:flux2 = klein 4B, random:flux2_9b), the tiny
test one, and building them.

FLUX.2 [klein] (black-forest-labs/FLUX.2-klein-4B, -9B and their -base variants) is an MMDiT (diffusers'
Flux2Transformer2DModel: 5 double-stream and 20 single-stream blocks, 24 heads of 128 for 4B; 8 and 24, 32 heads for
9B; no guidance embedding), conditioned on Qwen3's hidden states after layers 9, 18 and 27 side by side (3 x 2560 =
7680 features for Qwen3-4B), with the 32-channel FLUX.2 autoencoder (diffusers AutoencoderKLFlux2) whose latents are
patchified 2x2 (128 channels) and normalised by the AE's own batch-norm statistics. The tiny preset keeps every class
and the text layers 9/18/27 (28 Qwen3 layers); widths and depths shrink. Its tokenizer is local: byte-level BPE with
Qwen's chat tokens and <think> / </think>.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.families.common.qwen3 import qwen3_config
from library.families.common.tiny import build_seeded, tiny_vocab_and_merges
from library.families.common.diffusers_import import diffusers_classes

LATENT_CHANNELS = 32  # the AE's; the DiT sees them patchified 2x2 (128)
PATCHED_CHANNELS = LATENT_CHANNELS * 4
PRESET_SEED = 20251125
QWEN3_REAL_VOCAB_SIZE = 151936
QWEN3_TOKENIZER_REPO = "Qwen/Qwen3-4B"
TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
PAD_TOKEN, IM_START, IM_END, THINK, THINK_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
# Flux2KleinPipeline: the tokenizer's chat template with add_generation_prompt and enable_thinking=False, which for
# Qwen3 renders exactly this around one user message (an empty thinking block closes the assistant's preamble).
CHAT_TEMPLATE = (IM_START + "user\n{}" + IM_END + "\n" + IM_START + "assistant\n" + THINK + "\n\n" + THINK_END
                 + "\n\n")


@dataclass(frozen=True)
class Flux2Preset:
    """A built-in FLUX.2 klein model: the sizes of every part."""

    name: str
    double_layers: int
    single_layers: int
    heads: int
    head_dim: int
    axes_dims: tuple[int, int, int, int]
    guidance_embeds: bool
    qwen_hidden: int
    qwen_intermediate: int
    qwen_layers: int
    qwen_heads: int
    qwen_kv_heads: int
    qwen_head_dim: int
    vae_channels: tuple[int, ...]
    qwen_vocab: int | None = None  # None: the local tokenizer's vocabulary


PRESETS: dict[str, Flux2Preset] = {
    "tiny:flux2": Flux2Preset("tiny:flux2", double_layers=2, single_layers=3, heads=2, head_dim=16,
                              axes_dims=(4, 4, 4, 4), guidance_embeds=False, qwen_hidden=32, qwen_intermediate=64,
                              qwen_layers=28, qwen_heads=2, qwen_kv_heads=1, qwen_head_dim=16,
                              vae_channels=(32, 32, 64, 64)),
    # black-forest-labs/FLUX.2-klein-4B transformer/config.json and Qwen3-4B's config.
    "random:flux2": Flux2Preset("random:flux2", double_layers=5, single_layers=20, heads=24, head_dim=128,
                                axes_dims=(32, 32, 32, 32), guidance_embeds=False, qwen_hidden=2560,
                                qwen_intermediate=9728, qwen_layers=36, qwen_heads=32, qwen_kv_heads=8,
                                qwen_head_dim=128, vae_channels=(128, 256, 512, 512), qwen_vocab=QWEN3_REAL_VOCAB_SIZE),
    # black-forest-labs/FLUX.2-klein-9B and Qwen3-8B.
    "random:flux2_9b": Flux2Preset("random:flux2_9b", double_layers=8, single_layers=24, heads=32, head_dim=128,
                                   axes_dims=(32, 32, 32, 32), guidance_embeds=False, qwen_hidden=4096,
                                   qwen_intermediate=12288, qwen_layers=36, qwen_heads=32, qwen_kv_heads=8,
                                   qwen_head_dim=128, vae_channels=(128, 256, 512, 512),
                                   qwen_vocab=QWEN3_REAL_VOCAB_SIZE),
}


def transformer_config(p: Flux2Preset) -> dict:
    """Keyword arguments of diffusers' Flux2Transformer2DModel for a preset."""
    return dict(patch_size=1, in_channels=PATCHED_CHANNELS, out_channels=None, num_layers=p.double_layers,
                num_single_layers=p.single_layers, attention_head_dim=p.head_dim, num_attention_heads=p.heads,
                joint_attention_dim=p.qwen_hidden * len(TEXT_LAYERS), timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=tuple(p.axes_dims), rope_theta=2000, eps=1e-6, guidance_embeds=p.guidance_embeds)


def vae_config(block_out_channels: tuple[int, ...]) -> dict:
    """AutoencoderKLFlux2 kwargs: 32 latent channels, quant convs, 2x2 patches under batch norm (its defaults)."""
    n = len(block_out_channels)
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_out_channels),
                layers_per_block=2, latent_channels=LATENT_CHANNELS, norm_num_groups=32)




def build_qwen3_tokenizer():
    """A small local tokenizer in Qwen3's shape: byte-level BPE, the chat and thinking tokens, right padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = tiny_vocab_and_merges()
    words = [t for t in vocab if not t.endswith("</w>") and not t.startswith("<|")]
    specials = [PAD_TOKEN, IM_START, IM_END, THINK, THINK_END]
    tokens = {t: i for i, t in enumerate([*words, *specials])}
    ordered = [(a, b) for a, b in merges if not b.endswith("</w>") and a + b in tokens]
    core = Tokenizer(models.BPE(vocab=tokens, merges=ordered))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD_TOKEN,
                                        additional_special_tokens=specials[1:], model_max_length=40960)
    tokenizer.padding_side = "right"
    # Qwen3's chat template reduced to what Flux2KleinPipeline renders (so the pipeline runs on a written tiny folder)
    tokenizer.chat_template = (
        "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
        "{% if add_generation_prompt %}" + IM_START + "assistant\n{% if enable_thinking is defined and "
        "enable_thinking is false %}" + THINK + "\n\n" + THINK_END + "\n\n{% endif %}{% endif %}")
    return tokenizer


def qwen3_shape(p: Flux2Preset) -> dict:
    return dict(hidden=p.qwen_hidden, intermediate=p.qwen_intermediate, layers=p.qwen_layers, heads=p.qwen_heads,
                kv_heads=p.qwen_kv_heads, head_dim=p.qwen_head_dim)


def build_flux2_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """DiT, AE, Qwen3 and its tokenizer of a preset ("tiny:flux2", "random:flux2", "random:flux2_9b").

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a fixed seed,
    identical on every call. The AE's batch-norm statistics are drawn too (a fresh one has mean 0, variance 1).
    Returns {"transformer", "vae", "text_encoder", "tokenizer"}.
    """
    AutoencoderKLFlux2, Flux2Transformer2DModel = diffusers_classes("AutoencoderKLFlux2", "Flux2Transformer2DModel")
    from transformers import Qwen3Model

    p = PRESETS[name]
    tokenizer = build_qwen3_tokenizer()
    config = qwen3_config(**qwen3_shape(p), vocab=p.qwen_vocab or len(tokenizer))

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    transformer = make(0, lambda: Flux2Transformer2DModel(**transformer_config(p)))
    vae = make(1, lambda: AutoencoderKLFlux2(**vae_config(p.vae_channels)))
    text_encoder = make(2, lambda: Qwen3Model(config))
    if torch.device(device).type != "meta":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(PRESET_SEED + 10)
            with torch.no_grad():
                # zero-initialised tensors drawn too, so that the tiny model's every part is seen
                for tensor in transformer.parameters():
                    if not tensor.abs().any():
                        tensor.normal_(0.0, 0.02)
                vae.bn.running_mean.normal_(0.0, 0.5)
                vae.bn.running_var.uniform_(0.5, 2.0)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}
