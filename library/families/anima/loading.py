"""Load Anima from the files users have, and write the tiny preset in the same layouts.

- the DiT: one `.safetensors` with `net.*` keys (ComfyUI's `anima-preview.safetensors`, sd-scripts'
  saves), the LLM adapter inside it (`net.llm_adapter.*`) or given by --llm_adapter_path;
- --qwen3: Qwen3-0.6B as one file (`qwen_3_06b_base.safetensors`, `model.*` keys) or a transformers folder;
- --vae: the Qwen-Image VAE as ComfyUI's `qwen_image_vae.safetensors` (Wan 2.1 names: `encoder.downsamples.*`,
  `conv1`) or in diffusers' names (`encoder.down_blocks.*`, the Qwen-Image repo's vae file);
- the T5 tokenizer of the adapter: --t5_tokenizer_path, else google/t5-v1_1-xxl from --tokenizer_cache_dir or
  the local HF cache (the tiny one for the tiny adapter).

Every configuration is read from tensor shapes; models are built on the meta device and adopt the tensors.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from library.core.safetensors_io import write_safetensors
from library.families.anima import layout
from library.families.anima.configs import (
    LATENT_CHANNELS,
    PRESETS,
    QWEN3_TOKENIZER_REPO,
    AnimaDiT,
    build_anima_modules,
    build_qwen3_tokenizer,
    transformer_config,
    vae_config,
)
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.qwen3 import load_qwen3
from library.families.common.t5 import find_t5_tokenizer
from library.families.common.loading import adopt, read_file
from library.families.common.loading import classify_source
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.common.wan_vae import read_vae_tensors, to_wan
from library.families.common.diffusers_import import diffusers_class


def anima_source_kind(path: str) -> str:
    """"preset" or "single_file" (a ModelLoadError naming the problem otherwise)."""
    return classify_source(path, PRESETS, "Anima", file_suffixes=(".safetensors",),
                           expected="an Anima DiT .safetensors file (net.* keys) or the preset tiny:anima")


# --- the DiT and its adapter -----------------------------------------------------------------------------

def load_dit_file(path: str, dtype: torch.dtype, adapter_path: Optional[str] = None,
                  label: str = "--pretrained_model_name_or_path") -> AnimaDiT:
    """AnimaDiT from an original DiT file; the adapter from it, or from `adapter_path` (--llm_adapter_path)."""
    CosmosTransformer3DModel = diffusers_class("CosmosTransformer3DModel")

    tensors = read_file(label, path, "an Anima / Cosmos-Predict2 DiT (net.blocks.* keys)",
                         lambda keys: any(re.match(r"(model\.diffusion_model\.)?(net\.)?blocks\.0\.self_attn\.", k)
                                          for k in keys), dtype)
    dit, adapter = layout.split_original(tensors)
    try:
        shape = layout.infer_transformer_shape(dit)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete Anima DiT, no tensor for net.{e.args[0]}") from None
    if shape["in_channels"] != LATENT_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected a DiT on {LATENT_CHANNELS} latent channels (+ padding mask), "
                             f"found {shape['in_channels']}")
    preset = PRESETS["random:anima"]
    config = transformer_config(preset) | dict(num_layers=shape["blocks"], num_attention_heads=shape["heads"],
                                               attention_head_dim=shape["head_dim"],
                                               adaln_lora_dim=shape["adaln_lora_dim"], text_embed_dim=shape["text_dim"])
    transformer = adopt(label, path, lambda: CosmosTransformer3DModel(**config), layout.to_diffusers(dit))
    if adapter_path:
        adapter = load_adapter_file(adapter_path, dtype)
    elif not adapter:
        raise ModelLoadError(f"{label} {path}: holds no LLM adapter (no net.{layout.ADAPTER_MARKER}); "
                             f"give it with --llm_adapter_path")
    else:
        adapter = _adapter_from_tensors(label, path, adapter)
    return AnimaDiT(transformer, adapter).eval()


def load_adapter_file(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """--llm_adapter_path: the adapter alone (`llm_adapter.*`, `net.llm_adapter.*` or bare `blocks.*` keys)."""
    label = "--llm_adapter_path"
    tensors = read_file(label, path, "an Anima LLM adapter (llm_adapter.* keys)",
                         lambda keys: any(k.endswith("out_proj.weight") for k in keys), dtype)
    _, adapter = layout.split_original(tensors)
    return _adapter_from_tensors(label, path, adapter or tensors)


def _adapter_from_tensors(label: str, path: str, tensors: dict) -> torch.nn.Module:
    AnimaTextConditioner = diffusers_class("AnimaTextConditioner")

    try:
        shape = layout.infer_adapter_shape(tensors)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete LLM adapter, no tensor for llm_adapter.{e.args[0]}") from None
    config = dict(source_dim=shape["source_dim"], target_dim=shape["width"], model_dim=shape["width"],
                  num_layers=shape["layers"], num_attention_heads=shape["heads"], mlp_ratio=4.0,
                  target_vocab_size=shape["vocab"], use_self_attention=True, use_layer_norm=False,
                  min_sequence_length=0)
    return adopt(label, path, lambda: AnimaTextConditioner(**config), tensors)






def load_t5_tokenizer(path: Optional[str], vocab_size: int, tokenizer_cache_dir: Optional[str], model_path: str):
    """--t5_tokenizer_path, else the T5 tokenizer matching the adapter's vocabulary (tiny or T5 v1.1's)."""
    if path:
        from transformers import T5TokenizerFast

        try:
            return T5TokenizerFast.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - any failure is a bad folder for the user
            raise ModelLoadError(f"--t5_tokenizer_path {path}: not a T5 tokenizer folder "
                                 f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    try:
        return find_t5_tokenizer(vocab_size, tokenizer_cache_dir, model_path)
    except ModelLoadError as e:
        raise ModelLoadError(str(e).replace("--t5xxl", "--t5_tokenizer_path (LLM adapter of)")) from None


# --- the VAE -------------------------------------------------------------------------------------------

def load_vae_file(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """AutoencoderKLQwenImage from --vae: a file in Wan / ComfyUI names or in diffusers' names
    (library/families/common/wan_vae.py reads both)."""
    AutoencoderKLQwenImage = diffusers_class("AutoencoderKLQwenImage")

    label = "--vae"
    tensors = read_vae_tensors(label, path, dtype)
    try:
        base_dim = tensors["encoder.conv_in.weight"].shape[0]
        z_dim = tensors["post_quant_conv.weight"].shape[0]
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete VAE, no tensor for {e.args[0]}") from None
    if z_dim != LATENT_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected the Qwen-Image VAE with {LATENT_CHANNELS} latent channels, "
                             f"found {z_dim}")
    return adopt(label, path, lambda: AutoencoderKLQwenImage(**vae_config(base_dim)), tensors)


# --- all parts -----------------------------------------------------------------------------------------

def load_anima_components(opts: LoadOptions, options) -> Components:
    """Components of Anima: denoiser = AnimaDiT (DiT + LLM adapter), text encoders = [Qwen3],
    tokenizers = [Qwen3's, T5's]. `options`: AnimaOptions (--qwen3, --llm_adapter_path, --t5_tokenizer_path;
    the VAE is LoadOptions.vae)."""
    path = opts.pretrained_model_name_or_path
    kind = anima_source_kind(path)
    cache = opts.tokenizer_cache_dir
    if kind == "single_file":
        if not options.qwen3:
            raise ModelLoadError(f"--qwen3: required with an Anima DiT file ({path})")
        dit = load_dit_file(path, opts.dtype, options.llm_adapter_path)
        text_encoder, tokenizer = load_qwen3(options.qwen3, opts.dtype, cache, tokenizer_repo=QWEN3_TOKENIZER_REPO,
                                                   tiny_tokenizer=build_qwen3_tokenizer)
        # The LoRA tools (merge, extract, resize) need no VAE; training and generation check for --vae first.
        vae = load_vae_file(opts.vae, opts.vae_dtype) if opts.vae else None
    else:
        parts = build_anima_modules(path)
        dit, vae, text_encoder, tokenizer = parts["dit"], parts["vae"], parts["text_encoder"], parts["tokenizer"]
        if options.llm_adapter_path:
            dit.llm_adapter = load_adapter_file(options.llm_adapter_path, opts.dtype)
        if options.qwen3:
            text_encoder, tokenizer = load_qwen3(options.qwen3, opts.dtype, cache, tokenizer_repo=QWEN3_TOKENIZER_REPO,
                                                   tiny_tokenizer=build_qwen3_tokenizer)
        if opts.vae:
            vae = load_vae_file(opts.vae, opts.vae_dtype)
    if opts.from_scratch:
        from library.families.common.loading import scratch_denoiser

        dit.transformer = scratch_denoiser(dit.transformer, opts.init_seed)
    t5_tokenizer = load_t5_tokenizer(options.t5_tokenizer_path, dit.llm_adapter.config.target_vocab_size, cache, path)
    for module, dtype in ((dit, opts.dtype), (text_encoder, opts.dtype), (vae, opts.vae_dtype)):
        if module is not None and next(module.parameters()).dtype != dtype:
            module.to(dtype=dtype)
    return Components(denoiser=dit, vae=vae, text_encoders=[text_encoder], tokenizers=[tokenizer, t5_tokenizer],
                      model_path=path, vae_path=opts.vae)


def block_count(path: str) -> Optional[int]:
    """DiT blocks of a preset or DiT file, read without loading weights; None when the path cannot tell."""
    try:
        if anima_source_kind(path) == "preset":
            return PRESETS[path].blocks
        return indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?(?:net\.)?blocks\.(\d+)\.")
    except (OSError, ValueError, ModelLoadError):
        return None


def check_model_source(path: str, options, vae: Optional[str]) -> None:
    """The checks of load_anima_components that need no weights (one-line ModelLoadError)."""
    if anima_source_kind(path) == "single_file":
        for flag, value in (("qwen3", options.qwen3), ("vae", vae)):
            if not value:
                raise ModelLoadError(f"--{flag}: required with an Anima DiT file ({path})")


# --- writing -------------------------------------------------------------------------------------------

def write_dit_file(dit: AnimaDiT, path: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict] = None) -> str:
    """The DiT with its adapter as one original-layout file (`net.*`, metadata `format: pt` as the official file)."""
    write_safetensors(layout.original_tensors(dit), path, {"format": "pt", **(metadata or {})}, dtype=dtype)
    return path


def write_anima_preset(name: str, out_dir: str) -> dict[str, str]:
    """A preset written as the files users have: the DiT (anima-tiny.safetensors), qwen_3_06b_base.safetensors
    (`model.*` keys) and qwen_image_vae.safetensors (Wan / ComfyUI names). Returns {"dit", "qwen3", "vae"}."""
    parts = build_anima_modules(name)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"dit": os.path.join(out_dir, "anima-tiny.safetensors"),
             "qwen3": os.path.join(out_dir, "qwen_3_06b_base.safetensors"),
             "vae": os.path.join(out_dir, "qwen_image_vae.safetensors")}
    write_dit_file(parts["dit"], paths["dit"])
    write_safetensors({"model." + k: v for k, v in parts["text_encoder"].state_dict().items()}, paths["qwen3"])
    write_safetensors(to_wan(parts["vae"].state_dict()), paths["vae"])
    return paths

