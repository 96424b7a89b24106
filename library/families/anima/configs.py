"""Model configurations of Anima: the full-size one (random:anima), the tiny test one, and building them.

Anima is NVIDIA's Cosmos-Predict2 2B DiT ("MiniTrainDIT", diffusers' CosmosTransformer3DModel) with
an LLM adapter (diffusers' AnimaTextConditioner) that turns Qwen3-0.6B hidden states plus T5 token ids
into the DiT's 1024-wide cross-attention input, and the Qwen-Image VAE (AutoencoderKLQwenImage, 16
latent channels, 8x down). The tiny preset keeps every class and the Qwen3 layer count (28), so LoRA
names and counts of the text encoder equal the real model's; widths and DiT / adapter depth shrink.
Tokenizers are local: a small byte-level BPE one in Qwen3's shape (no BOS, pads with <|endoftext|>)
and the tiny T5 one of tiny:flux.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from library.families.common.qwen3 import qwen3_config
from library.families.common.t5 import T5_REAL_VOCAB_SIZE, build_t5_tokenizer
from library.families.common.tiny import build_seeded, tiny_byte_level_bpe
from library.families.common.diffusers_import import diffusers_classes

LATENT_CHANNELS = 16
PRESET_SEED = 20240611
QWEN3_REAL_VOCAB_SIZE = 151936
QWEN3_PAD_TOKEN = "<|endoftext|>"
QWEN3_TOKENIZER_REPO = "Qwen/Qwen3-0.6B"  # the tokenizer of qwen_3_06b_base.safetensors
QWEN3_LAYERS = 28


@dataclass(frozen=True)
class AnimaPreset:
    """A built-in Anima model: the sizes of every part."""

    name: str
    blocks: int
    heads: int
    head_dim: int
    adaln_lora_dim: int
    text_dim: int  # Qwen3 hidden size = adapter width = the DiT's cross-attention input (1024)
    adapter_layers: int
    adapter_heads: int
    qwen3_intermediate: int
    qwen3_heads: int
    qwen3_kv_heads: int
    qwen3_head_dim: int
    vae_base_dim: int
    max_size: tuple[int, int, int] = (128, 512, 512)  # (frames, latent h, latent w), sd-scripts' max_img_h/w
    qwen3_vocab: int | None = None  # None: the local tokenizer's vocabulary
    t5_vocab: int | None = None


PRESETS: dict[str, AnimaPreset] = {
    "tiny:anima": AnimaPreset("tiny:anima", blocks=3, heads=2, head_dim=24, adaln_lora_dim=16, text_dim=32,
                              adapter_layers=2, adapter_heads=2, qwen3_intermediate=64, qwen3_heads=2,
                              qwen3_kv_heads=1, qwen3_head_dim=16, vae_base_dim=8, max_size=(8, 64, 64)),
    "random:anima": AnimaPreset("random:anima", blocks=28, heads=16, head_dim=128, adaln_lora_dim=256,
                                text_dim=1024, adapter_layers=6, adapter_heads=16, qwen3_intermediate=3072,
                                qwen3_heads=16, qwen3_kv_heads=8, qwen3_head_dim=128, vae_base_dim=96,
                                qwen3_vocab=QWEN3_REAL_VOCAB_SIZE, t5_vocab=T5_REAL_VOCAB_SIZE),
}


def transformer_config(p: AnimaPreset) -> dict:
    """Keyword arguments of diffusers' CosmosTransformer3DModel for a preset (Cosmos-Predict2 text2image:
    AdaLN-LoRA, 3D RoPE scaled (1, 4, 4), padding-mask channel, no extra learnable position embedding)."""
    return dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=p.heads,
                attention_head_dim=p.head_dim, num_layers=p.blocks, mlp_ratio=4.0, text_embed_dim=p.text_dim,
                adaln_lora_dim=p.adaln_lora_dim, max_size=tuple(p.max_size), patch_size=(1, 2, 2),
                rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True, extra_pos_embed_type=None)


def adapter_config(p: AnimaPreset, t5_vocab: int) -> dict:
    """Keyword arguments of diffusers' AnimaTextConditioner (the LLM adapter) for a preset."""
    return dict(source_dim=p.text_dim, target_dim=p.text_dim, model_dim=p.text_dim, num_layers=p.adapter_layers,
                num_attention_heads=p.adapter_heads, mlp_ratio=4.0, target_vocab_size=t5_vocab,
                use_self_attention=True, use_layer_norm=False, min_sequence_length=0)




def vae_config(base_dim: int) -> dict:
    """AutoencoderKLQwenImage kwargs: Qwen-Image's (= Wan 2.1's) shape at base width `base_dim`, its latent stats."""
    return dict(base_dim=base_dim, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0)


def build_qwen3_tokenizer():
    """A small local tokenizer in Qwen3's shape: byte-level BPE, no BOS, <|endoftext|> pads and ends."""
    from transformers import PreTrainedTokenizerFast

    core = tiny_byte_level_bpe(after=[QWEN3_PAD_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=QWEN3_PAD_TOKEN, pad_token=QWEN3_PAD_TOKEN,
                                   model_max_length=131072)


class AnimaDiT(nn.Module):
    """Anima's denoiser as one module: the Cosmos DiT and the LLM adapter that feeds its cross-attention.

    Module paths equal the original single file's after `net.` (`blocks.N...` renamed by anima_layout,
    `llm_adapter.*` as is), so LoRA names come straight from them. The adapter runs inside forward, so
    data-parallel training sees its gradients like any other parameter's.
    """

    def __init__(self, transformer: nn.Module, llm_adapter: nn.Module):
        super().__init__()
        # Images carry an all-zero padding mask (as sd-scripts passes). diffusers resizes it with torchvision,
        # which this project does not need, so the zero channel goes in as the condition mask instead: the same
        # 17-channel input to patch_embed, and the same weights.
        if transformer.config.concat_padding_mask:
            transformer.register_to_config(concat_padding_mask=False)
        self.transformer = transformer
        self.llm_adapter = llm_adapter

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def config(self):
        return self.transformer.config

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        for part in (self.transformer, self.llm_adapter):
            if gradient_checkpointing_func is None:
                part.enable_gradient_checkpointing()
            else:
                part.enable_gradient_checkpointing(gradient_checkpointing_func=gradient_checkpointing_func)

    def text_embeddings(self, prompt_embeds: torch.Tensor, attn_mask: torch.Tensor, t5_input_ids: torch.Tensor,
                        t5_attn_mask: torch.Tensor) -> torch.Tensor:
        """The DiT's cross-attention input: the adapter's output, zero at T5 padding (as sd-scripts)."""
        return self.llm_adapter(prompt_embeds, t5_input_ids.long(), target_attention_mask=t5_attn_mask,
                                source_attention_mask=attn_mask)

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, prompt_embeds: torch.Tensor,
                attn_mask: torch.Tensor, t5_input_ids: torch.Tensor, t5_attn_mask: torch.Tensor) -> torch.Tensor:
        """(B, 16, h, w) latents and σ in [0, 1] (B,) -> the velocity estimate (B, 16, h, w)."""
        context = self.text_embeddings(prompt_embeds, attn_mask, t5_input_ids, t5_attn_mask)
        return self.denoise(latents, timesteps, context)

    def denoise(self, latents: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The DiT alone on an adapter output `context` (generation reuses one context for every step)."""
        b, _, h, w = latents.shape
        padding = torch.zeros(b, 1, 1, h, w, device=latents.device, dtype=latents.dtype)
        out = self.transformer(hidden_states=latents.unsqueeze(2), timestep=timesteps.to(latents.dtype),
                               encoder_hidden_states=context.to(latents.dtype), condition_mask=padding,
                               return_dict=False)[0]
        return out.squeeze(2)


def qwen3_shape(p: AnimaPreset) -> dict:
    return dict(hidden=p.text_dim, intermediate=p.qwen3_intermediate, layers=QWEN3_LAYERS, heads=p.qwen3_heads,
                kv_heads=p.qwen3_kv_heads, head_dim=p.qwen3_head_dim)


def build_anima_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """DiT (with its adapter), VAE, Qwen3 and both tokenizers of a preset ("tiny:anima", "random:anima").

    On device "meta" nothing is allocated (for counting modules); otherwise the weights are random from a
    fixed seed, identical on every call. Returns {"dit", "vae", "text_encoder", "tokenizer", "t5_tokenizer"}.
    """
    AnimaTextConditioner, AutoencoderKLQwenImage, CosmosTransformer3DModel = diffusers_classes(
        "AnimaTextConditioner", "AutoencoderKLQwenImage", "CosmosTransformer3DModel")
    from transformers import Qwen3Model

    p = PRESETS[name]
    qwen_tok, t5_tok = build_qwen3_tokenizer(), build_t5_tokenizer()
    qwen_cfg = qwen3_config(**qwen3_shape(p), vocab=p.qwen3_vocab or len(qwen_tok))

    def make(index: int, factory):
        return build_seeded(factory, PRESET_SEED + index, device)

    transformer = make(0, lambda: CosmosTransformer3DModel(**transformer_config(p)))
    adapter = make(1, lambda: AnimaTextConditioner(**adapter_config(p, p.t5_vocab or len(t5_tok))))
    vae = make(2, lambda: AutoencoderKLQwenImage(**vae_config(p.vae_base_dim)))
    text_encoder = make(3, lambda: Qwen3Model(qwen_cfg))
    dit = AnimaDiT(transformer, adapter)
    for module in (dit, vae, text_encoder):
        module.eval()
    return {"dit": dit, "vae": vae, "text_encoder": text_encoder, "tokenizer": qwen_tok, "t5_tokenizer": t5_tok}
