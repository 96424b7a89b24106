"""Model configurations of FLUX.2 klein and dev: the full-size ones (random:flux2 = klein 4B, random:flux2_9b,
random:flux2_dev), the tiny test ones (tiny:flux2, tiny:flux2_dev), and building them.

FLUX.2 [klein] (black-forest-labs/FLUX.2-klein-4B, -9B and their -base variants) is an MMDiT (diffusers'
Flux2Transformer2DModel: 5 double-stream and 20 single-stream blocks, 24 heads of 128 for 4B; 8 and 24, 32 heads for
9B; no guidance embedding), conditioned on Qwen3's hidden states after layers 9, 18 and 27 side by side (3 x 2560 =
7680 features for Qwen3-4B), with the 32-channel FLUX.2 autoencoder (diffusers AutoencoderKLFlux2) whose latents are
patchified 2x2 (128 channels) and normalised by the AE's own batch-norm statistics. The tiny preset keeps every class
and the text layers 9/18/27 (28 Qwen3 layers); widths and depths shrink. Its tokenizer is local: byte-level BPE with
Qwen's chat tokens and <think> / </think>.

FLUX.2 [dev] (black-forest-labs/FLUX.2-dev) is the same MMDiT at 32B (8 double, 48 single blocks, 48 heads of 128),
with a guidance embedding (guidance-distilled: the guidance value is an input, as FLUX.1 dev's), conditioned on
Mistral-Small-3.1's hidden states after layers 10, 20 and 30 (3 x 5120 = 15360 features; diffusers' Flux2Pipeline).
tiny:flux2_dev keeps the 40 Mistral layers, its head width 128 and the tokenizer's Mistral control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.families.common.qwen3 import preset_qwen3_config
from library.families.common.tiny import build_seeded, draw_zero_parameters, seeded, tiny_byte_level_bpe
from library.families.common.diffusers_import import diffusers_classes

LATENT_CHANNELS = 32  # the AE's; the DiT sees them patchified 2x2 (128)
PATCHED_CHANNELS = LATENT_CHANNELS * 4
PRESET_SEED = 20251125
QWEN3_REAL_VOCAB_SIZE = 151936
QWEN3_TOKENIZER_REPO = "Qwen/Qwen3-4B"
TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
MISTRAL_TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline's text_encoder_out_layers (FLUX.2 [dev])
MISTRAL_REAL_VOCAB_SIZE = 131072
# BFL's system prompt of FLUX.2 [dev]'s text encoder (flux2/src/flux2/system_messages.py; diffusers' SYSTEM_MESSAGE)
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
# Mistral's control tokens in the order of its tokenizer (ids 0-18; [IMG] = 10, the model's image_token_index)
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
# Mistral-Small-3.1's chat template reduced to its text path: BOS, the system prompt, each user turn in [INST]
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% if system is not string %}{% set system = system[0]['text'] %}{% endif %}"
    "[SYSTEM_PROMPT]{{ system }}[/SYSTEM_PROMPT]"
    "{% for m in loop_messages %}{% if m['role'] == 'user' %}[INST]{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for block in m['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}{% else %}[IMG]"
    "{% endif %}{% endfor %}{% endif %}[/INST]{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}")
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
    mistral: "MistralShape | None" = None  # FLUX.2 [dev]: Mistral-Small-3.1 text (the qwen_* sizes unused)

    @property
    def text_width(self) -> int:
        return self.mistral.hidden if self.mistral else self.qwen_hidden


@dataclass(frozen=True)
class MistralShape:
    """Sizes of FLUX.2 [dev]'s Mistral3 text encoder (its text model; a one-layer vision tower beside it)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int | None = None  # None: the local tokenizer's


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
    # tiny FLUX.2 [dev]: guidance embedding, Mistral3 text (40 layers as the real one, head width 128)
    "tiny:flux2_dev": Flux2Preset("tiny:flux2_dev", double_layers=2, single_layers=3, heads=2, head_dim=16,
                                  axes_dims=(4, 4, 4, 4), guidance_embeds=True, qwen_hidden=0, qwen_intermediate=0,
                                  qwen_layers=0, qwen_heads=0, qwen_kv_heads=0, qwen_head_dim=0,
                                  vae_channels=(32, 32, 64, 64),
                                  mistral=MistralShape(hidden=32, intermediate=64, layers=40, heads=2, kv_heads=1)),
    # black-forest-labs/FLUX.2-dev transformer/config.json and Mistral-Small-3.1-24B's text config.
    "random:flux2_dev": Flux2Preset("random:flux2_dev", double_layers=8, single_layers=48, heads=48, head_dim=128,
                                    axes_dims=(32, 32, 32, 32), guidance_embeds=True, qwen_hidden=0,
                                    qwen_intermediate=0, qwen_layers=0, qwen_heads=0, qwen_kv_heads=0,
                                    qwen_head_dim=0, vae_channels=(128, 256, 512, 512),
                                    mistral=MistralShape(hidden=5120, intermediate=32768, layers=40, heads=32,
                                                         kv_heads=8, vocab=MISTRAL_REAL_VOCAB_SIZE)),
}


def is_dev(p: Flux2Preset) -> bool:
    return p.mistral is not None


def transformer_config(p: Flux2Preset) -> dict:
    """Keyword arguments of diffusers' Flux2Transformer2DModel for a preset."""
    return dict(patch_size=1, in_channels=PATCHED_CHANNELS, out_channels=None, num_layers=p.double_layers,
                num_single_layers=p.single_layers, attention_head_dim=p.head_dim, num_attention_heads=p.heads,
                joint_attention_dim=p.text_width * len(TEXT_LAYERS), timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=tuple(p.axes_dims), rope_theta=2000, eps=1e-6, guidance_embeds=p.guidance_embeds)


def vae_config(block_out_channels: tuple[int, ...]) -> dict:
    """AutoencoderKLFlux2 kwargs: 32 latent channels, quant convs, 2x2 patches under batch norm (its defaults)."""
    n = len(block_out_channels)
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_out_channels),
                layers_per_block=2, latent_channels=LATENT_CHANNELS, norm_num_groups=32)



def build_qwen3_tokenizer():
    """A small local tokenizer in Qwen3's shape: byte-level BPE, the chat and thinking tokens, right padding."""
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, IM_START, IM_END, THINK, THINK_END]
    core = tiny_byte_level_bpe(after=specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD_TOKEN,
                                        additional_special_tokens=specials[1:], model_max_length=40960)
    tokenizer.padding_side = "right"
    # Qwen3's chat template reduced to what Flux2KleinPipeline renders (so the pipeline runs on a written tiny folder)
    tokenizer.chat_template = (
        "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
        "{% if add_generation_prompt %}" + IM_START + "assistant\n{% if enable_thinking is defined and "
        "enable_thinking is false %}" + THINK + "\n\n" + THINK_END + "\n\n{% endif %}{% endif %}")
    return tokenizer


def build_mistral_tokenizer():
    """A small local tokenizer in Mistral-Small-3.1's shape: Mistral's control tokens at their ids, byte-level BPE,
    <pad> (id 11) on the right, and the text path of its chat template (FLUX.2 [dev]'s processor reduced to its
    tokenizer: the pipeline calls only apply_chat_template, which both have)."""
    from transformers import PreTrainedTokenizerFast

    core = tiny_byte_level_bpe(before=MISTRAL_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", additional_special_tokens=list(MISTRAL_SPECIALS[3:]),
                                        model_max_length=131072)
    tokenizer.padding_side = "right"
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def mistral_tokenizer_size() -> int:
    return len(build_mistral_tokenizer())


def build_mistral3(p: Flux2Preset, vocab: int):
    """Mistral3ForConditionalGeneration of a dev preset: its text model at the preset's sizes, a one-layer Pixtral
    vision tower and the projector (the folder's class; FLUX.2 reads the text path only)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    from library.families.common.mistral3 import mistral_text_config

    m = p.mistral
    text = mistral_text_config(hidden=m.hidden, intermediate=m.intermediate, layers=m.layers, heads=m.heads,
                               kv_heads=m.kv_heads, vocab=vocab)
    if m.vocab is None:  # the tiny one: a one-layer vision tower
        vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                                     head_dim=16, patch_size=14, image_size=56)
    else:
        vision = PixtralVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                     num_attention_heads=16, head_dim=64, patch_size=14, image_size=1540)
    config = Mistral3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=10,
                            projector_hidden_act="gelu", spatial_merge_size=2, multimodal_projector_bias=False,
                            vision_feature_layer=-1)
    return Mistral3ForConditionalGeneration(config)


def build_flux2_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """DiT, AE, text encoder and its tokenizer of a preset ("tiny:flux2", "random:flux2", "random:flux2_9b"; the dev
    ones "tiny:flux2_dev", "random:flux2_dev": the text encoder a whole Mistral3ForConditionalGeneration).

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a fixed seed,
    identical on every call. The AE's batch-norm statistics are drawn too (a fresh one has mean 0, variance 1).
    Returns {"transformer", "vae", "text_encoder", "tokenizer"}.
    """
    AutoencoderKLFlux2, Flux2Transformer2DModel = diffusers_classes("AutoencoderKLFlux2", "Flux2Transformer2DModel")
    from transformers import Qwen3Model

    p = PRESETS[name]

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    transformer = make(0, lambda: Flux2Transformer2DModel(**transformer_config(p)))
    vae = make(1, lambda: AutoencoderKLFlux2(**vae_config(p.vae_channels)))
    if is_dev(p):
        tokenizer = build_mistral_tokenizer()
        text_encoder = make(2, lambda: build_mistral3(p, p.mistral.vocab or len(tokenizer)))
    else:
        tokenizer = build_qwen3_tokenizer()
        config = preset_qwen3_config(p, tokenizer)
        text_encoder = make(2, lambda: Qwen3Model(config))
    if torch.device(device).type != "meta":
        with seeded(PRESET_SEED + 10), torch.no_grad():
            draw_zero_parameters(transformer)
            vae.bn.running_mean.normal_(0.0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}
