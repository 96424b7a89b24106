"""Load SD3 / SD3.5 from what --pretrained_model_name_or_path names: a preset, a diffusers folder
(StableDiffusion3Pipeline layout), or a SAI single file.

A SAI file (sd3_medium_incl_clips_t5xxlfp16.safetensors, sd3.5_large.safetensors, ...) holds the
MMDiT under `model.diffusion_model.`, the VAE under `first_stage_model.` and, in the all-in-one
files, the text encoders under `text_encoders.{clip_l,clip_g,t5xxl}.transformer.`. As in
sd-scripts, --clip_l / --clip_g / --t5xxl give a text encoder the file lacks (or replace it) and
--vae replaces the VAE; each part's configuration is read from its tensor shapes. With a preset
or a diffusers folder the same flags replace that part. Models are built on the meta device and
adopt the file's tensors. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Mapping, Optional

import torch

from library.families.common import ldm_layout as ldm
from library.families.sd3 import layout as sai
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.t5 import t5_from_tensors
from library.families.common.loading import adopt, read_file
from library.families.common.loading import (
    classify_source,
    find_tokenizer,
    load_folder_parts,
    scratch_denoiser,
)
from library.families.sd3.configs import (
    LATENT_CHANNELS,
    PRESETS,
    build_sd3_modules,
    sd3_vae_config,
)
from library.families.common.configs import te1_config, te2_config
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
# --clip_l / --clip_g / --t5xxl: the part each gives, its tokenizer, and what the file should hold.
_COMPONENT_FLAGS = (("clip_l", "text_encoder", "tokenizer", "a CLIP-L text encoder (clip_l.safetensors)"),
                    ("clip_g", "text_encoder_2", "tokenizer_2", "a CLIP-G text encoder (clip_g.safetensors)"),
                    ("t5xxl", "text_encoder_3", "tokenizer_3", "a T5-XXL text encoder (t5xxl_fp16.safetensors)"))
_EXPECTED = "a local diffusers folder, a SAI .safetensors file, or a preset such as tiny:sd3"


def sd3_source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file"; ModelLoadError naming the problem otherwise."""
    return classify_source(path, PRESETS, "SD3", folder_parts=PARTS[:2], file_suffixes=(".safetensors",),
                           expected=_EXPECTED)


def _holds_mmdit(keys: list[str]) -> bool:
    return any(k.startswith(("joint_blocks.", sai.SAI_PREFIX + "joint_blocks.")) for k in keys)


def _diffusers_parts(folder: str, skip: set[str], scratch_seed: Optional[int] = None) -> dict:
    AutoencoderKL, SD3Transformer2DModel = diffusers_classes("AutoencoderKL", "SD3Transformer2DModel")
    from transformers import (
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5EncoderModel,
        T5TokenizerFast,
    )

    classes = {"transformer": SD3Transformer2DModel, "vae": AutoencoderKL,
               "text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
               "text_encoder_3": T5EncoderModel, "tokenizer": CLIPTokenizer, "tokenizer_2": CLIPTokenizer,
               "tokenizer_3": T5TokenizerFast}
    for encoder, tokenizer in (("text_encoder_3", "tokenizer_3"),):
        if encoder not in skip and not os.path.isdir(os.path.join(folder, encoder)):
            raise ModelLoadError(f"{folder}: SD3 diffusers folder has no {encoder}/ (T5-XXL); give --t5xxl")
    skipped = set(skip) | {tok for _, enc, tok, _ in _COMPONENT_FLAGS if enc in skip}
    return load_folder_parts(folder, {k: v for k, v in classes.items() if k not in skipped}, "SD3",
                             scratch=None if scratch_seed is None else ("transformer", scratch_seed))


# --- parts from tensors ----------------------------------------------------------------------------

def transformer_from_tensors(label: str, path: str, tensors: Mapping[str, torch.Tensor]):
    """SD3Transformer2DModel (in SAI order, sd3/layout.py to_sai_order) from SAI MMDiT tensors."""
    SD3Transformer2DModel = diffusers_class("SD3Transformer2DModel")

    try:
        config = sai.infer_transformer_config(tensors)
        state_dict = sai.sai_to_diffusers(tensors)
    except sai.SaiLayoutError as e:
        raise ModelLoadError(f"{label} {path}: {e}") from None
    return sai.to_sai_order(adopt(label, path, lambda: SD3Transformer2DModel(**config), state_dict))


def clip_from_tensors(label: str, path: str, tensors: Mapping[str, torch.Tensor], big_g: bool,
                      tokenizer_cache_dir: Optional[str] = None):
    """(CLIPTextModelWithProjection, tokenizer) of CLIP-L (`big_g` False) or CLIP-G from HF-named tensors
    (`text_model.*`, `text_projection.weight`, optionally under `transformer.`)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    ckpt = {(k[len("transformer."):] if k.startswith("transformer.") else k): v for k, v in tensors.items()}
    ckpt = {k: v for k, v in ckpt.items() if not k.endswith(("position_ids", "logit_scale"))}
    p = "text_model."
    try:
        tokens = ckpt[p + "embeddings.token_embedding.weight"]
        positions = ckpt[p + "embeddings.position_embedding.weight"]
        fc1 = ckpt[p + "encoder.layers.0.mlp.fc1.weight"]
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete, no tensor for {e.args[0]}") from None
    hidden = tokens.shape[1]
    if "text_projection.weight" not in ckpt:  # as sd-scripts: CLIP-L files without one get the identity
        ckpt["text_projection.weight"] = torch.eye(hidden, dtype=tokens.dtype)
    layers = len({m[1] for k in ckpt if (m := re.match(r"text_model\.encoder\.layers\.(\d+)\.", k))})
    tokenizer = find_tokenizer(big_g, tokens.shape[0], tokenizer_cache_dir, path)
    make = te2_config if big_g else te1_config
    kwargs = make(hidden_size=hidden, intermediate_size=fc1.shape[0], num_hidden_layers=layers,
                  vocab_size=tokens.shape[0], tokenizer=tokenizer, max_position_embeddings=positions.shape[0],
                  **({"projection_dim": ckpt["text_projection.weight"].shape[0]} if big_g else {}))
    kwargs["projection_dim"] = ckpt["text_projection.weight"].shape[0]
    return adopt(label, path, lambda: CLIPTextModelWithProjection(CLIPTextConfig(**kwargs)), ckpt), tokenizer


def vae_from_tensors(label: str, path: str, tensors: Mapping[str, torch.Tensor], prefix: str):
    """The SD3 AutoencoderKL (16 latent channels, no quant convs) from LDM VAE tensors under `prefix`."""
    AutoencoderKL = diffusers_class("AutoencoderKL")

    from library.families.common.loading import infer_vae_config

    try:
        found = infer_vae_config(tensors, prefix)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: VAE tensors are incomplete ({e})") from None
    if found["latent_channels"] != LATENT_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected the SD3 VAE with {LATENT_CHANNELS} latent channels, "
                             f"found {found['latent_channels']} (an SD/SDXL VAE?)")
    config = {**sd3_vae_config(found["block_out_channels"]), "layers_per_block": found["layers_per_block"]}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoencoderKL(**config).state_dict().items()}
    try:
        state_dict = ldm.pull(tensors, ldm.vae_key_map(shapes, prefix), shapes)
    except (ldm.LayoutError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: VAE tensors are incomplete or mis-shaped ({e})") from None
    return adopt(label, path, lambda: AutoencoderKL(**config), state_dict)


# --- whole files ------------------------------------------------------------------------------------

def _component_file(flag: str, path: str, opts: LoadOptions):
    """(text encoder, tokenizer) from the file --clip_l / --clip_g / --t5xxl names."""
    what = next(w for f, _, _, w in _COMPONENT_FLAGS if f == flag)
    if flag == "t5xxl":
        tensors = read_file(f"--{flag}", path, what, lambda keys: any(k.startswith("encoder.block.") for k in keys),
                             opts.dtype)
        return t5_from_tensors(f"--{flag}", path, tensors, opts.tokenizer_cache_dir)
    tensors = read_file(f"--{flag}", path, what,
                         lambda keys: any("embeddings.token_embedding." in k for k in keys), opts.dtype)
    return clip_from_tensors(f"--{flag}", path, tensors, flag == "clip_g", opts.tokenizer_cache_dir)


def _component_parts(files, opts: LoadOptions) -> dict:
    parts: dict = {}
    for flag, encoder, tokenizer, _ in _COMPONENT_FLAGS:
        path = getattr(files, flag, None)
        if path:
            parts[encoder], parts[tokenizer] = _component_file(flag, path, opts)
    if opts.vae:
        parts["vae"] = load_sd3_vae(opts.vae, opts.vae_dtype)
    return parts


def load_sd3_vae(path: str, dtype: torch.dtype = torch.float32):
    """--vae: a diffusers VAE folder, or a .safetensors file of SD3 VAE tensors (optionally under first_stage_model.)."""
    if os.path.isdir(path):
        from library.families.common.loading import load_vae

        return load_vae(path)
    tensors = read_file("--vae", path, "the SD3 VAE (encoder.*, decoder.* keys)",
                         lambda keys: any(k.startswith(("encoder.conv_in.", sai.VAE_PREFIX + "encoder.conv_in."))
                                          for k in keys), dtype)
    prefix = sai.VAE_PREFIX if any(k.startswith(sai.VAE_PREFIX) for k in tensors) else ""
    return vae_from_tensors("--vae", path, tensors, prefix)


def load_sai_file(path: str, files, opts: LoadOptions) -> dict:
    """Every part from a SAI single file, with --clip_l / --clip_g / --t5xxl / --vae for what it lacks or replaces."""
    label = "--pretrained_model_name_or_path"
    tensors = read_file(label, path, "an SD3 MMDiT in the SAI layout (joint_blocks.* keys)", _holds_mmdit,
                         opts.dtype)
    parts = {"transformer": transformer_from_tensors(label, path, tensors)}
    given = _component_parts(files, opts)
    for flag, encoder, tokenizer, what in _COMPONENT_FLAGS:
        if encoder in given:
            continue
        inside = sai.text_encoder_tensors(tensors, flag)
        if not inside:
            raise ModelLoadError(f"--{flag}: required, {path} holds no {flag} text encoder; give {what}")
        if flag == "t5xxl":
            parts[encoder], parts[tokenizer] = t5_from_tensors(label, path, inside, opts.tokenizer_cache_dir)
        else:
            parts[encoder], parts[tokenizer] = clip_from_tensors(label, path, inside, flag == "clip_g",
                                                                 opts.tokenizer_cache_dir)
    if "vae" not in given:
        if not any(k.startswith(sai.VAE_PREFIX) for k in tensors):
            raise ModelLoadError(f"--vae: required, {path} holds no VAE (first_stage_model.*)")
        parts["vae"] = vae_from_tensors(label, path, tensors, sai.VAE_PREFIX)
    parts.update(given)
    return parts


def missing_component_flags(path: str, files) -> Optional[str]:
    """The one-line error of a SAI file that lacks a text encoder or VAE and has no flag for it (header only)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - the loader reports an unreadable file
        return None
    for flag, _, _, what in _COMPONENT_FLAGS:
        if not getattr(files, flag, None) and not any(k.startswith(sai.TEXT_ENCODER_PREFIXES[flag]) for k in keys):
            return f"--{flag}: required, {path} holds no {flag} text encoder; give {what}"
    return None


def block_count(path: str) -> Optional[int]:
    """Joint blocks of a preset, diffusers folder or SAI file, read without loading weights; None when unknown."""
    try:
        kind = sd3_source_kind(path)
        if kind == "preset":
            return PRESETS[path].layers
        if kind == "diffusers":
            with open(os.path.join(path, "transformer", "config.json"), encoding="utf-8") as f:
                return int(json.load(f)["num_layers"])
        return indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?joint_blocks\.(\d+)\.")
    except (OSError, ValueError, KeyError, ModelLoadError):
        return None


def load_sd3_components(opts: LoadOptions, files=None) -> Components:
    """Components of an SD3 model: denoiser = transformer (SAI order), text encoders = [CLIP-L, CLIP-G, T5]."""
    path = opts.pretrained_model_name_or_path
    kind = sd3_source_kind(path)
    if kind == "single_file":
        parts = load_sai_file(path, files, opts)
    else:
        replaced = _component_parts(files, opts)
        scratch_seed = opts.init_seed if opts.from_scratch else None
        parts = build_sd3_modules(path) if kind == "preset" else _diffusers_parts(path, set(replaced), scratch_seed)
        parts.update(replaced)
        if "text_encoder_3" not in parts:
            raise ModelLoadError(f"{path}: no T5-XXL text encoder; give --t5xxl")
    if opts.from_scratch and kind != "diffusers":
        parts["transformer"] = scratch_denoiser(parts["transformer"], opts.init_seed)
    sai.to_sai_order(parts["transformer"])
    for key, dtype in (("transformer", opts.dtype), ("text_encoder", opts.dtype), ("text_encoder_2", opts.dtype),
                       ("text_encoder_3", opts.dtype), ("vae", opts.vae_dtype)):
        if parts[key].dtype != dtype:
            parts[key].to(dtype=dtype)
    return Components(denoiser=parts["transformer"], vae=parts["vae"],
                      text_encoders=[parts["text_encoder"], parts["text_encoder_2"], parts["text_encoder_3"]],
                      tokenizers=[parts["tokenizer"], parts["tokenizer_2"], parts["tokenizer_3"]], model_path=path,
                      vae_path=opts.vae)

