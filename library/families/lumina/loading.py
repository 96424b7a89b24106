"""Load Lumina Image 2.0 from the files users have, and write the tiny preset in the same layouts.

- the DiT: one `.safetensors` in the original NextDiT names (`layers.N.attention.qkv`, Alpha-VLLM's
  `consolidated` file, sd-scripts' saves) or ComfyUI's whole-model file (`model.diffusion_model.*`);
- --gemma2: Gemma-2 2B as one file (`model.*` keys as sd-scripts / ComfyUI's gemma_2_2b file, or bare
  `layers.*`) or a transformers folder;
- --ae: the FLUX.1 autoencoder (BFL's ae.safetensors), read by the FLUX.1 family's loader;
- the Gemma tokenizer: the tiny one for the tiny encoder, else google/gemma-2-2b from --tokenizer_cache_dir or
  the local HF cache (as sd-scripts' strategy_lumina.py).

Every configuration is read from tensor shapes; models are built on the meta device and adopt the tensors.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from library.core.safetensors_io import write_safetensors
from library.families.lumina import layout
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.autoencoder import ae_file_tensors, load_ae_file
from library.families.common.loading import (adopt, cached_tokenizer, classify_source, finish_components,
                                             load_dit_parts, read_dit_file, read_file)
from library.families.lumina.configs import (
    GEMMA2_TOKENIZER_REPO,
    LATENT_CHANNELS,
    PRESETS,
    build_gemma2_tokenizer,
    build_lumina_modules,
    gemma2_config,
    transformer_config,
)
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.common.diffusers_import import diffusers_class

_DIT_MARKER = re.compile(r"^(model\.diffusion_model\.)?layers\.0\.attention\.qkv\.")


def lumina_source_kind(path: str) -> str:
    """"preset" or "single_file" (a ModelLoadError naming the problem otherwise)."""
    return classify_source(path, PRESETS, "Lumina", file_suffixes=(".safetensors",),
                           expected="a Lumina Image 2.0 DiT .safetensors file or the preset tiny:lumina")


def load_dit_file(path: str, dtype: torch.dtype, label: str = "--pretrained_model_name_or_path"):
    """Lumina2Transformer2DModel from an original NextDiT file (or ComfyUI's whole-model file)."""
    Lumina2Transformer2DModel = diffusers_class("Lumina2Transformer2DModel")

    tensors, shape = read_dit_file(label, path, dtype,
                                   expected="a Lumina Image 2.0 DiT (layers.*.attention.qkv keys)",
                                   marker=_DIT_MARKER, infer_shape=layout.infer_shape, what="Lumina DiT")
    if shape["patch_in"] != LATENT_CHANNELS * 4:
        raise ModelLoadError(f"{label} {path}: expected a DiT on {LATENT_CHANNELS} latent channels in 2x2 patches, "
                             f"found x_embedder input {shape['patch_in']}")
    head_dim = shape["head_dim"]
    axes = (head_dim // 3,) * 3 if head_dim % 3 == 0 and head_dim // 3 % 2 == 0 else None
    if axes is None:
        raise ModelLoadError(f"{label} {path}: head width {head_dim} does not split into 3 even RoPE axes")
    base = transformer_config(PRESETS["random:lumina2"])
    # diffusers rounds the FFN width up to multiple_of; the file's own width as multiple_of gives exactly it.
    multiple_of = base["multiple_of"] if shape["ffn"] % base["multiple_of"] == 0 else shape["ffn"]
    config = base | dict(hidden_size=shape["hidden"], num_layers=shape["layers"],
                         num_refiner_layers=shape["refiner_layers"], num_attention_heads=shape["heads"],
                         num_kv_heads=shape["kv_heads"], multiple_of=multiple_of, axes_dim_rope=axes,
                         cap_feat_dim=shape["cap_feat_dim"])
    modulated = {m[1] for k in tensors if (m := re.match(r"((layers|noise_refiner|context_refiner)\.\d+)\."
                                                           r"adaLN_modulation\.", k))}
    state = layout.to_diffusers(tensors, shape["heads"], shape["kv_heads"], modulated)
    return adopt(label, path, lambda: Lumina2Transformer2DModel(**config), state)


def load_gemma2(path: str, dtype: torch.dtype, tokenizer_cache_dir: Optional[str] = None):
    """(Gemma2Model, tokenizer) from --gemma2: a transformers folder, or one file (`model.*`, ComfyUI's
    `text_encoders.gemma2_2b.transformer.model.*` or bare keys; lm_head ignored)."""
    from transformers import AutoTokenizer, Gemma2Model

    label = "--gemma2"
    if os.path.isdir(path):
        try:
            model = Gemma2Model.from_pretrained(path, torch_dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{label} {path}: not a Gemma-2 folder ({str(e).splitlines()[0][:200]})") from None
        tokenizer.padding_side = "right"
        return model.eval(), tokenizer
    raw = read_file(label, path, "a Gemma-2 text encoder (model.layers.* keys)",
                     lambda keys: any(re.search(r"(^|\.)layers\.0\.post_feedforward_layernorm\.", k) for k in keys),
                     dtype)
    tensors = {}
    for key, value in raw.items():
        for prefix in ("text_encoders.gemma2_2b.transformer.model.", "model."):
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key.startswith(("embed_tokens.", "layers.", "norm.")):
            tensors[key] = value
    try:
        vocab, hidden = tensors["embed_tokens.weight"].shape
        q = tensors["layers.0.self_attn.q_proj.weight"].shape[0]
        k = tensors["layers.0.self_attn.k_proj.weight"].shape[0]
        # gemma-2-2b: 8 heads of 256; the tiny preset: 2 of 16 (heads of a file read as q width / 256, or 16 small)
        head_dim = 256 if q % 256 == 0 and k % 256 == 0 else 16
        config = gemma2_config(hidden=hidden, intermediate=tensors["layers.0.mlp.gate_proj.weight"].shape[0],
                               layers=len({m[1] for key in tensors if (m := re.match(r"layers\.(\d+)\.", key))}),
                               heads=q // head_dim, kv_heads=k // head_dim, head_dim=head_dim, vocab=vocab)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete Gemma-2, no tensor for model.{e.args[0]}") from None
    model = adopt(label, path, lambda: Gemma2Model(config), tensors)
    return model, find_gemma2_tokenizer(vocab, tokenizer_cache_dir, path)


def find_gemma2_tokenizer(vocab_size: int, tokenizer_cache_dir: Optional[str], path: str):
    """The tiny tokenizer for the tiny encoder, else Gemma-2's from --tokenizer_cache_dir or the local HF cache."""
    tiny = build_gemma2_tokenizer()
    if vocab_size == len(tiny):
        return tiny
    tokenizer = cached_tokenizer(GEMMA2_TOKENIZER_REPO, tokenizer_cache_dir)
    if tokenizer is not None:
        tokenizer.padding_side = "right"
        return tokenizer
    raise ModelLoadError(f"--gemma2 {path}: the {GEMMA2_TOKENIZER_REPO} tokenizer is not cached locally; pass "
                         f"--tokenizer_cache_dir with a saved copy (folder {GEMMA2_TOKENIZER_REPO.replace('/', '_')}), "
                         f"or give --gemma2 as a Gemma-2 folder")


def load_lumina_components(opts: LoadOptions, options) -> Components:
    """Components of Lumina: denoiser = Lumina2Transformer2DModel, text encoders = [Gemma2Model],
    tokenizers = [Gemma's], vae = the FLUX.1 AE (`options`: LuminaOptions with --gemma2 / --ae)."""
    path = opts.pretrained_model_name_or_path
    kind = lumina_source_kind(path)
    if kind == "single_file" and not options.gemma2:
        raise ModelLoadError(f"--gemma2: required with a Lumina DiT file ({path})")
    ae_path = options.ae or opts.vae
    text_file = (lambda: load_gemma2(options.gemma2, opts.dtype, opts.tokenizer_cache_dir)) if options.gemma2 else None
    parts, _ = load_dit_parts(opts, kind, ae_path, dit_file=load_dit_file, text_file=text_file, ae_file=load_ae_file,
                              preset=build_lumina_modules)
    return finish_components(opts, parts["transformer"], [parts["text_encoder"]], [parts["tokenizer"]], parts["vae"],
                             ae_path)


def check_model_source(path: str, options, vae: Optional[str]) -> None:
    """The checks of load_lumina_components that need no weights (one-line ModelLoadError)."""
    if lumina_source_kind(path) == "single_file":
        for flag, value in (("gemma2", options.gemma2), ("ae", options.ae or vae)):
            if not value:
                raise ModelLoadError(f"--{flag}: required with a Lumina DiT file ({path})")


def block_count(path: str) -> Optional[int]:
    """Joint blocks (`layers.N`) of a preset or DiT file, read without loading weights; None when it cannot tell."""
    try:
        if lumina_source_kind(path) == "preset":
            return PRESETS[path].layers
        return indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?layers\.(\d+)\.")
    except (OSError, ValueError, ModelLoadError):
        return None


# --- writing -------------------------------------------------------------------------------------------

def write_dit_file(transformer, path: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict] = None) -> str:
    """The DiT as one original-layout NextDiT file (q, k, v fused into attention.qkv)."""
    write_safetensors(layout.to_original(transformer.state_dict()), path, metadata or {}, dtype=dtype)
    return path


def write_lumina_preset(name: str, out_dir: str) -> dict[str, str]:
    """A preset written as the files users have: the DiT (lumina-tiny.safetensors, NextDiT names),
    gemma_2_2b.safetensors (`model.*` keys) and ae.safetensors (BFL's LDM names). Returns {"dit", "gemma2", "ae"}."""
    parts = build_lumina_modules(name)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"dit": os.path.join(out_dir, "lumina-tiny.safetensors"),
             "gemma2": os.path.join(out_dir, "gemma_2_2b.safetensors"),
             "ae": os.path.join(out_dir, "ae.safetensors")}
    write_dit_file(parts["transformer"], paths["dit"])
    write_safetensors({"model." + k: v for k, v in parts["text_encoder"].state_dict().items()}, paths["gemma2"])
    write_safetensors(ae_file_tensors(parts["vae"].state_dict()), paths["ae"])
    return paths
