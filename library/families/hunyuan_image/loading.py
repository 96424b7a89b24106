"""Load HunyuanImage 2.1 from the files users have, and write the tiny preset in the same layouts.

- the DiT: one `.safetensors` in the original names (Tencent's dit/hunyuanimage2.1.safetensors, sd-scripts' and
  ComfyUI's; ComfyUI's whole-model prefix `model.diffusion_model.` accepted);
- --text_encoder: Qwen2.5-VL-7B as one file (`model.*` language-model keys as ComfyUI's qwen_2.5_vl_7b.safetensors;
  `visual.*` and `lm_head` are not used) or a transformers folder;
- --byt5: the glyph byT5 encoder (`shared.weight` + `encoder.*`, ComfyUI's byt5_small_glyphxl_fp16.safetensors);
- --vae: the VAE in the original Encoder / Decoder names (hunyuan_image_2.1_vae_fp16.safetensors);
- tokenizers: byT5's is built locally (bytes), Qwen2.5-VL's is the tiny one for the tiny encoder, else
  Qwen/Qwen2.5-VL-7B-Instruct from --tokenizer_cache_dir or the local HF cache (as sd-scripts' strategy).

Every configuration is read from tensor shapes; models are built on the meta device and adopt the tensors.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from library.core.safetensors_io import write_safetensors
from library.families.hunyuan_image import layout
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.qwen_vl import load_qwen_vl
from library.families.common.loading import adopt, finish_components, read_dit_file, read_file
from library.families.hunyuan_image.configs import (
    LATENT_CHANNELS,
    PRESETS,
    build_byt5_tokenizer,
    build_hunyuan_image_modules,
    byt5_config,
    transformer_config,
    vae_config,
)
from library.families.common.loading import classify_source
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.common.diffusers_import import diffusers_class

_DIT_MARKER = re.compile(r"^(model\.diffusion_model\.)?double_blocks\.0\.img_attn_qkv\.")


def source_kind(path: str) -> str:
    """"preset" or "single_file" (a ModelLoadError naming the problem otherwise)."""
    return classify_source(path, PRESETS, "HunyuanImage", file_suffixes=(".safetensors",),
                           expected="a HunyuanImage 2.1 DiT .safetensors file or the preset tiny:hunyuan_image")


def load_dit_file(path: str, dtype: torch.dtype, label: str = "--pretrained_model_name_or_path"):
    """HunyuanImageTransformer2DModel from an original DiT file."""
    HunyuanImageTransformer2DModel = diffusers_class("HunyuanImageTransformer2DModel")

    tensors, shape = read_dit_file(label, path, dtype,
                                   expected="a HunyuanImage 2.1 DiT (double_blocks.*.img_attn_qkv keys)",
                                   marker=_DIT_MARKER, infer_shape=layout.infer_shape, what="HunyuanImage DiT")
    if shape["latent_channels"] != LATENT_CHANNELS or shape["byt5_dim"] is None:
        raise ModelLoadError(f"{label} {path}: expected the HunyuanImage 2.1 DiT ({LATENT_CHANNELS} latent channels, "
                             f"byt5_in), found img_in input {shape['latent_channels']}"
                             f"{'' if shape['byt5_dim'] else ' and no byt5_in'}")
    head_dim = shape["head_dim"]
    base = transformer_config(PRESETS["random:hunyuan_image"])
    config = base | dict(num_attention_heads=shape["heads"], attention_head_dim=head_dim,
                         num_layers=shape["double"], num_single_layers=shape["single"],
                         num_refiner_layers=shape["refiner"], text_embed_dim=shape["text_dim"],
                         text_embed_2_dim=shape["byt5_dim"], rope_axes_dim=(head_dim // 2, head_dim // 2))
    state = layout.to_diffusers(tensors, shape["hidden"])
    return adopt(label, path, lambda: HunyuanImageTransformer2DModel(**config), state)


def load_byt5(path: str, dtype: torch.dtype):
    """(T5EncoderModel, tokenizer) from --byt5: the glyph byT5 file (`shared.weight`, `encoder.*`)."""
    from transformers import T5EncoderModel

    label = "--byt5"
    raw = read_file(label, path, "a byT5 text encoder (encoder.block.* keys)",
                     lambda keys: "shared.weight" in keys and any(k.startswith("encoder.block.0.") for k in keys), dtype)
    tensors = {k: v for k, v in raw.items() if k == "shared.weight" or k.startswith("encoder.")}
    tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"]
    tokenizer = build_byt5_tokenizer()
    try:
        vocab, d_model = tensors["shared.weight"].shape
        d_kv_total = tensors["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0]
        heads = tensors["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
        config = byt5_config(d_model, tensors["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
                             d_kv_total // heads, heads,
                             len({m[1] for k in tensors if (m := re.match(r"encoder\.block\.(\d+)\.", k))}), vocab)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete byT5, no tensor for {e.args[0]}") from None
    if vocab != len(tokenizer):
        raise ModelLoadError(f"{label} {path}: expected the glyph byT5 ({len(tokenizer)} tokens: byT5's 384 and "
                             f"sd-scripts' colour and font tokens), found a vocabulary of {vocab}")
    return adopt(label, path, lambda: T5EncoderModel(config), tensors), tokenizer


def _vae_levels(tensors) -> tuple[int, int]:
    levels = len({m[1] for k in tensors if (m := re.match(r"encoder\.down\.(\d+)\.", k))})
    per_block = len({m[1] for k in tensors if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k))})
    return levels, per_block


def load_vae_file(path: str, dtype: torch.dtype, label: str = "--vae"):
    """AutoencoderKLHunyuanImage from the original VAE file (Encoder / Decoder names, no prefix)."""
    AutoencoderKLHunyuanImage = diffusers_class("AutoencoderKLHunyuanImage")

    raw = read_file(label, path, "the HunyuanImage 2.1 VAE (encoder.down.* keys)",
                     lambda keys: any(k.startswith("encoder.down.0.block.0.") for k in keys), dtype)
    tensors = {k[len("vae."):] if k.startswith("vae.") else k: v for k, v in raw.items()}
    levels, per_block = _vae_levels(tensors)
    channels = tuple(tensors[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] for i in range(levels))
    if tensors["encoder.conv_out.weight"].shape[0] != 2 * LATENT_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected a VAE with {LATENT_CHANNELS} latent channels, found "
                             f"{tensors['encoder.conv_out.weight'].shape[0] // 2}")
    state = layout.vae_to_diffusers(tensors, levels, per_block)
    return adopt(label, path, lambda: AutoencoderKLHunyuanImage(**vae_config(channels, per_block)), state)


def load_components(opts: LoadOptions, options) -> Components:
    """Components: denoiser = HunyuanImageTransformer2DModel, text encoders = [Qwen2.5-VL text model, byT5 encoder],
    tokenizers = [Qwen's, byT5's], vae = AutoencoderKLHunyuanImage (`options`: HunyuanImageOptions)."""
    path = opts.pretrained_model_name_or_path
    kind = source_kind(path)
    if kind == "single_file":
        check_model_source(path, options, opts.vae, need_vae=False)
        transformer = load_dit_file(path, opts.dtype)
        qwen, qwen_tok = load_qwen_vl(options.text_encoder, opts.dtype, opts.tokenizer_cache_dir)
        byt5, byt5_tok = load_byt5(options.byt5, opts.dtype)
        vae = load_vae_file(opts.vae, opts.vae_dtype) if opts.vae else None  # the LoRA tools need no VAE
    else:
        parts = build_hunyuan_image_modules(path)
        transformer, vae = parts["transformer"], parts["vae"]
        qwen, qwen_tok, byt5, byt5_tok = parts["qwen"], parts["qwen_tokenizer"], parts["byt5"], parts["byt5_tokenizer"]
        if options.text_encoder:
            qwen, qwen_tok = load_qwen_vl(options.text_encoder, opts.dtype, opts.tokenizer_cache_dir)
        if options.byt5:
            byt5, byt5_tok = load_byt5(options.byt5, opts.dtype)
        if opts.vae:
            vae = load_vae_file(opts.vae, opts.vae_dtype)
    return finish_components(opts, transformer, [qwen, byt5], [qwen_tok, byt5_tok], vae, opts.vae)


def check_model_source(path: str, options, vae: Optional[str], need_vae: bool = True) -> None:
    """The checks of load_components that need no weights (one-line ModelLoadError)."""
    if source_kind(path) == "single_file":
        for flag, value in (("text_encoder", options.text_encoder), ("byt5", options.byt5),
                            ("vae", vae if need_vae else "given")):
            if not value:
                raise ModelLoadError(f"--{flag}: required with a HunyuanImage DiT file ({path})")


def block_counts(path: str) -> Optional[tuple[int, int]]:
    """(double, single) blocks of a preset or DiT file, read without loading weights; None when it cannot tell."""
    try:
        if source_kind(path) == "preset":
            return PRESETS[path].double_blocks, PRESETS[path].single_blocks
        prefix = r"(?:model\.diffusion_model\.)?"
        double = indexed_blocks_in_file(path, prefix + r"double_blocks\.(\d+)\.")
        single = indexed_blocks_in_file(path, prefix + r"single_blocks\.(\d+)\.")
        return (double, single) if double and single else None
    except (OSError, ValueError, ModelLoadError):
        return None


# --- writing -------------------------------------------------------------------------------------------------------

def byt5_file_tensors(byt5) -> dict[str, torch.Tensor]:
    """A T5EncoderModel's tensors as the glyph byT5 file holds them (`shared.weight`, `encoder.*`, no tied copy)."""
    return {k: v for k, v in byt5.state_dict().items() if k != "encoder.embed_tokens.weight"}


def vae_file_tensors(vae) -> dict[str, torch.Tensor]:
    """An AutoencoderKLHunyuanImage's tensors in the original VAE file's names."""
    config = vae.config
    return layout.vae_to_original(vae.state_dict(), len(config.block_out_channels), config.layers_per_block)


def write_hunyuan_image_preset(name: str, out_dir: str) -> dict[str, str]:
    """A preset written as the files users have: the DiT (hunyuanimage2.1-tiny.safetensors, original names),
    qwen_2.5_vl_7b.safetensors (`model.*` keys), byt5_small_glyphxl.safetensors and the VAE (original names).
    Returns {"dit", "text_encoder", "byt5", "vae"}."""
    parts = build_hunyuan_image_modules(name)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"dit": os.path.join(out_dir, "hunyuanimage2.1-tiny.safetensors"),
             "text_encoder": os.path.join(out_dir, "qwen_2.5_vl_7b.safetensors"),
             "byt5": os.path.join(out_dir, "byt5_small_glyphxl.safetensors"),
             "vae": os.path.join(out_dir, "hunyuan_image_2.1_vae.safetensors")}
    write_safetensors(layout.to_original(parts["transformer"].state_dict()), paths["dit"])
    write_safetensors({"model." + k: v for k, v in parts["qwen"].state_dict().items()}, paths["text_encoder"])
    write_safetensors(byt5_file_tensors(parts["byt5"]), paths["byt5"])
    write_safetensors(vae_file_tensors(parts["vae"]), paths["vae"])
    return paths
