"""Load SDXL from what --pretrained_model_name_or_path names: a preset, a diffusers folder, or an SGM file.

Nothing is downloaded. Single files carry no tokenizers: the local toy ones
are used for tiny models, the real CLIP tokenizers from a local cache (or
--tokenizer_cache_dir) otherwise, exactly as the SD loader finds them.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from library.families.common import ldm_layout as ldm
from library.families.sdxl import layout as sgm
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.loading import (
    SINGLE_FILE_SUFFIXES,
    materialize,
    classify_source,
    find_tokenizer,
    load_folder_parts,
    load_vae,
    read_checkpoint,
    scratch_denoiser,
    vae_from_ldm,
)
from library.families.sd.configs import PRESETS as SD_PRESETS
from library.families.sdxl.configs import PRESETS, build_sdxl_modules
from library.families.common.configs import te1_config, te2_config
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

_PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def sdxl_source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file"; ModelLoadError naming the problem otherwise."""
    if path in PRESETS:
        return "preset"
    if path in SD_PRESETS:
        raise ModelLoadError(f"--pretrained_model_name_or_path: {path} is an SD 1.x/2.x preset, not SDXL; "
                             f"use train_network.py or one of {', '.join(PRESETS)}")
    return classify_source(path, PRESETS, "SDXL", folder_parts=_PARTS,
                           file_suffixes=SINGLE_FILE_SUFFIXES,
                           expected="a local diffusers folder, an SGM .safetensors file, or a preset")


def load_sdxl_components(opts: LoadOptions) -> Components:
    """Both text encoders and tokenizers, the UNet and the VAE, cast to the requested dtypes."""
    path = opts.pretrained_model_name_or_path
    kind = sdxl_source_kind(path)
    cache_dir = getattr(opts, "tokenizer_cache_dir", None)
    if kind == "preset":
        parts = build_sdxl_modules(path)
    elif kind == "single_file":
        parts = parts_from_sgm_checkpoint(read_checkpoint(path), path, cache_dir)
    else:
        parts = parts_from_diffusers_folder(path, opts.init_seed if opts.from_scratch else None)
    if opts.from_scratch and kind != "diffusers":  # (a folder's UNet is built from its config.json)
        parts["unet"] = scratch_denoiser(parts["unet"], opts.init_seed)
    if opts.vae:
        parts["vae"] = load_vae(opts.vae)
    for key in _PARTS:
        dtype = opts.vae_dtype if key == "vae" else opts.dtype
        if parts[key].dtype != dtype:
            parts[key].to(dtype=dtype)
    return Components(denoiser=parts["unet"], vae=parts["vae"],
                      text_encoders=[parts["text_encoder"], parts["text_encoder_2"]],
                      tokenizers=[parts["tokenizer"], parts["tokenizer_2"]],
                      v_parameterization=opts.v_parameterization, v2=False, model_path=path, vae_path=opts.vae)


def parts_from_sgm_checkpoint(checkpoint: Mapping[str, torch.Tensor], path: str,
                              tokenizer_cache_dir: Optional[str] = None) -> dict:
    """The four models and two tokenizers from one SGM-layout state dict."""
    UNet2DConditionModel = diffusers_class("UNet2DConditionModel")
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    sgm.check_sdxl_keys(checkpoint, path)
    try:
        unet_kwargs = sgm.infer_unet_config(checkpoint)
        unet = materialize(lambda: UNet2DConditionModel(**unet_kwargs),
                            lambda s: ldm.pull(checkpoint, sgm.unet_key_map(s, unet_kwargs["layers_per_block"]), s))
        vae = vae_from_ldm(checkpoint, sgm.VAE_PREFIX)
        shapes1, shapes2 = sgm.te1_shapes(checkpoint), sgm.te2_shapes(checkpoint)
        tok1 = find_tokenizer(False, shapes1["vocab_size"], tokenizer_cache_dir, path)
        tok2 = find_tokenizer(True, shapes2["vocab_size"], tokenizer_cache_dir, path)
        c1 = CLIPTextConfig(**te1_config(tokenizer=tok1, **shapes1))
        c2 = CLIPTextConfig(**te2_config(tokenizer=tok2, **shapes2))
        te1 = materialize(lambda: CLIPTextModel(c1), lambda s: ldm.pull(checkpoint, sgm.te1_key_map(s), s))
        te2 = materialize(lambda: CLIPTextModelWithProjection(c2), lambda s: sgm.pull_te2(checkpoint, s))
    except (ldm.LayoutError, ValueError, StopIteration) as e:
        raise ModelLoadError(f"{path}: SDXL checkpoint is incomplete or has unexpected shapes ({e})") from None
    return {"unet": unet, "vae": vae, "text_encoder": te1, "text_encoder_2": te2, "tokenizer": tok1,
            "tokenizer_2": tok2}


def parts_from_diffusers_folder(folder: str, scratch_seed: Optional[int] = None) -> dict:
    """The parts of an SDXL diffusers folder (as StableDiffusionXLPipeline.save_pretrained writes it);
    `scratch_seed` (--from_scratch): the UNet built from its config with weights drawn from it."""
    AutoencoderKL, UNet2DConditionModel = diffusers_classes("AutoencoderKL", "UNet2DConditionModel")
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    parts = load_folder_parts(folder, {
        "unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
        "text_encoder_2": CLIPTextModelWithProjection, "tokenizer": CLIPTokenizer, "tokenizer_2": CLIPTokenizer}, "SDXL",
        scratch=None if scratch_seed is None else ("unet", scratch_seed))
    if parts["unet"].config.addition_embed_type != "text_time":
        raise ModelLoadError(f"{folder}: its UNet has no SDXL text_time conditioning; not an SDXL base model")
    return parts
