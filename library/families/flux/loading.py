"""Load FLUX.1 from what --pretrained_model_name_or_path names: a preset, a diffusers folder, or a BFL single file.

A BFL single file (`flux1-dev.safetensors` / `flux1-schnell.safetensors`, optionally
under `model.diffusion_model.`, float8 allowed) holds only the transformer; the other
parts come from sd-scripts' flags: --clip_l (CLIP-L, HF keys as in ComfyUI's
clip_l.safetensors), --t5xxl (T5-XXL encoder, e.g. t5xxl_fp16.safetensors) and --ae
(ae.safetensors, the LDM VAE layout without prefix). Each part's configuration is
read from its tensor shapes. With a preset or a diffusers folder those flags replace
that part, as --vae replaces the VAE. Models are built on the meta device and adopt
the file's tensors, so loading holds one copy of the weights. Nothing is downloaded.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from library.families.flux import layout as bfl
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.flux.layout import (
    block_count,
    clip_l_from_file,
    transformer_tensors,
)
from library.families.flux.configs import PRESETS, build_flux_modules
from library.families.common.loading import (
    classify_source,
    find_tokenizer,
    load_folder_parts,
    load_vae,
    scratch_denoiser,
)
from library.families.common.configs import text_encoder_config
from library.families.common.loading import adopt, read_file
from library.families.common.gguf_file import GGUF_SUFFIX, adopt_gguf, gguf_keys, is_gguf, read_gguf
from library.families.common.t5 import load_t5xxl_file
from library.families.common.autoencoder import load_ae_file
from library.families.common.t5 import T5XXL_FILE
from library.families.common.autoencoder import AE_FILE
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

_PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2")
# --clip_l / --t5xxl / --ae: the part each replaces, and what the file should hold.
_COMPONENT_FLAGS = (("clip_l", "text_encoder", "a CLIP-L text encoder (clip_l.safetensors)"),
                    ("t5xxl", "text_encoder_2", T5XXL_FILE),
                    ("ae", "vae", AE_FILE))


def flux_source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file"; ModelLoadError naming the problem otherwise."""
    return classify_source(path, PRESETS, "FLUX.1", folder_parts=_PARTS, file_suffixes=(".safetensors", GGUF_SUFFIX),
                           gguf=True,
                           expected="a local diffusers folder, a BFL .safetensors file, a ComfyUI-GGUF .gguf file, "
                                    "or a preset such as tiny:flux")


def _diffusers_parts(folder: str, skip: set[str] = frozenset(), scratch_seed: Optional[int] = None) -> dict:
    """The parts of a FLUX.1 diffusers folder, except those in `skip` (given as files instead); `scratch_seed`
    (--from_scratch): the transformer built from its config with weights drawn from it."""
    AutoencoderKL, FluxTransformer2DModel = diffusers_classes("AutoencoderKL", "FluxTransformer2DModel")
    from transformers import (
        CLIPTextModel,
        CLIPTokenizer,
        T5EncoderModel,
        T5TokenizerFast,
    )

    classes = {"transformer": FluxTransformer2DModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
               "text_encoder_2": T5EncoderModel, "tokenizer": CLIPTokenizer, "tokenizer_2": T5TokenizerFast}
    return load_folder_parts(folder, {k: v for k, v in classes.items() if k not in skip}, "FLUX.1",
                             scratch=None if scratch_seed is None else ("transformer", scratch_seed))


# --- reading one file ------------------------------------------------------------------------


# --- the parts ---------------------------------------------------------------------------------

def load_bfl_transformer(path: str, dtype: torch.dtype = torch.float32, label: str = "--pretrained_model_name_or_path"):
    """FluxTransformer2DModel from a BFL single file (flux1-dev / flux1-schnell layout, any precision), or from a
    ComfyUI-GGUF file of it (`flux1-dev-Q8_0.gguf`: the same keys, its quantized weights kept quantized)."""
    FluxTransformer2DModel = diffusers_class("FluxTransformer2DModel")

    what = "a FLUX.1 transformer in the BFL layout (double_blocks.* keys)"

    def holds(keys):
        return any(k.startswith(("double_blocks.", bfl.BFL_PREFIX + "double_blocks.")) for k in keys)

    gguf = is_gguf(path)
    tensors = (read_gguf(label, path, what, holds, dtype, archs=("flux",)) if gguf
               else read_file(label, path, what, holds, dtype))
    try:
        config = bfl.infer_transformer_config(tensors)
        state_dict = bfl.bfl_to_diffusers(tensors)
    except bfl.BflLayoutError as e:
        raise ModelLoadError(f"{label} {path}: {e}") from None
    return (adopt_gguf if gguf else adopt)(label, path, lambda: FluxTransformer2DModel(**config), state_dict)


def load_clip_l_file(path: str, dtype: torch.dtype = torch.float32, tokenizer_cache_dir: Optional[str] = None):
    """(CLIPTextModel, tokenizer) from a CLIP-L file (`text_model.*` keys or transformers 5 bare keys)."""
    import re

    from transformers import CLIPTextConfig, CLIPTextModel


    label = "--clip_l"
    raw = read_file(label, path, _COMPONENT_FLAGS[0][2],
                     lambda keys: any("embeddings.token_embedding." in k for k in keys)
                     and any(k.startswith(("text_model.encoder.layers.", "encoder.layers.")) for k in keys), dtype)
    ckpt = clip_l_from_file(raw)
    try:
        tokens, positions = ckpt["embeddings.token_embedding.weight"], ckpt["embeddings.position_embedding.weight"]
        fc1 = ckpt["encoder.layers.0.mlp.fc1.weight"]
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete, no tensor for text_model.{e.args[0]}") from None
    layers = len({m[1] for k in ckpt if (m := re.match(r"encoder\.layers\.(\d+)\.", k))})
    tokenizer = find_tokenizer(False, tokens.shape[0], tokenizer_cache_dir, path)
    config = CLIPTextConfig(**text_encoder_config(
        False, hidden_size=tokens.shape[1], intermediate_size=fc1.shape[0], num_hidden_layers=layers,
        vocab_size=tokens.shape[0], max_position_embeddings=positions.shape[0], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    return adopt(label, path, lambda: CLIPTextModel(config), ckpt), tokenizer


# --- all parts ---------------------------------------------------------------------------------

def _component_parts(files, opts: LoadOptions) -> dict:
    """The parts that --clip_l / --t5xxl / --ae name (with their tokenizers)."""
    parts: dict = {}
    cache = opts.tokenizer_cache_dir
    if getattr(files, "clip_l", None):
        parts["text_encoder"], parts["tokenizer"] = load_clip_l_file(files.clip_l, opts.dtype, cache)
    if getattr(files, "t5xxl", None):
        parts["text_encoder_2"], parts["tokenizer_2"] = load_t5xxl_file(files.t5xxl, opts.dtype, cache)
    if getattr(files, "ae", None):
        parts["vae"] = load_ae_file(files.ae, opts.vae_dtype)
    return parts


def _require_component_files(files, path: str) -> None:
    for flag, _, what in _COMPONENT_FLAGS:
        if not getattr(files, flag, None):
            raise ModelLoadError(f"--{flag}: required with a BFL single-file transformer ({path}); "
                                 f"give {what}")


def block_counts(path: str) -> Optional[tuple[int, int]]:
    """(double, single) transformer blocks of a preset, diffusers folder or BFL file, read without
    loading weights; None when the path cannot tell (the loader then reports what is wrong)."""
    import json


    try:
        kind = flux_source_kind(path)
        if kind == "preset":
            return PRESETS[path].double_blocks, PRESETS[path].single_blocks
        if kind == "diffusers":
            with open(os.path.join(path, "transformer", "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            return int(config["num_layers"]), int(config["num_single_layers"])
        if is_gguf(path):
            keys = gguf_keys(path)
        else:
            from safetensors import safe_open

            with safe_open(path, "pt") as f:
                keys = list(transformer_tensors(dict.fromkeys(f.keys())))
        return block_count(keys, "double_blocks"), block_count(keys, "single_blocks")
    except (OSError, ValueError, KeyError, ModelLoadError):
        return None


def check_model_source(path: str, files) -> None:
    """The checks of load_flux_components that need no weights: the path's kind and, for a BFL file,
    the --clip_l / --t5xxl / --ae it requires (one-line ModelLoadError)."""
    if flux_source_kind(path) == "single_file":
        _require_component_files(files, path)


def load_flux_components(opts: LoadOptions, files=None) -> Components:
    """Components of a FLUX.1 model: denoiser = transformer, text encoders = [CLIP-L, T5].

    `files` carries the --clip_l / --t5xxl / --ae paths (library.families.flux.options.FluxOptions):
    required with a BFL single file, replacing that part of a preset or a diffusers folder.
    """
    path = opts.pretrained_model_name_or_path
    kind = flux_source_kind(path)
    if kind == "single_file":
        _require_component_files(files, path)
        parts = {"transformer": load_bfl_transformer(path, opts.dtype), **_component_parts(files, opts)}
    else:
        replaced = _component_parts(files, opts)
        scratch_seed = opts.init_seed if opts.from_scratch else None
        parts = build_flux_modules(path) if kind == "preset" else _diffusers_parts(path, set(replaced), scratch_seed)
        parts.update(replaced)
    if opts.from_scratch and kind != "diffusers":  # (a folder's transformer is built from its config.json)
        parts["transformer"] = scratch_denoiser(parts["transformer"], opts.init_seed)
    if opts.vae:

        parts["vae"] = load_vae(opts.vae)
    for key, dtype in (("transformer", opts.dtype), ("text_encoder", opts.dtype), ("text_encoder_2", opts.dtype),
                       ("vae", opts.vae_dtype)):
        if parts[key].dtype != dtype:
            parts[key].to(dtype=dtype)
    return Components(denoiser=parts["transformer"], vae=parts["vae"],
                      text_encoders=[parts["text_encoder"], parts["text_encoder_2"]],
                      tokenizers=[parts["tokenizer"], parts["tokenizer_2"]], model_path=path, vae_path=opts.vae)
