"""Loading SD 1.x / 2.x: a preset, a single .safetensors / .ckpt file in the LDM layout, or a diffusers folder."""

from __future__ import annotations

import logging
import os
import re
from typing import Mapping, Optional

import torch

from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common import ldm_layout as ldm
from library.families.common.loading import (
    cached_hub_folder,
    classify_source,
    find_tokenizer,
    infer_text_encoder_config,
    load_folder_parts,
    load_vae,
    materialize,
    read_checkpoint,
    scratch_denoiser,
    vae_from_ldm,
)
from library.families.sd.configs import PRESETS, build_sd_modules, unet_config
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

logger = logging.getLogger(__name__)



def source_kind(path: str) -> str:
    """What an SD 1.x/2.x model path is: "preset", "diffusers", "single_file" or "hub"; ModelLoadError if none."""
    return classify_source(path, PRESETS, allow_hub=True)


def load_sd_components(opts: LoadOptions) -> Components:
    """Load the UNet, VAE, text encoder and tokenizer that `opts` names, cast to the requested dtypes."""
    path = opts.pretrained_model_name_or_path
    kind = source_kind(path)
    v_param = opts.v_parameterization
    if kind == "preset":
        parts = build_sd_modules(path)
        v_param = v_param or PRESETS[path].v_parameterization
    elif kind == "single_file":
        parts = parts_from_checkpoint(read_checkpoint(path), path, getattr(opts, "tokenizer_cache_dir", None))
    else:
        folder = path if kind == "diffusers" else cached_hub_folder(path)
        parts = parts_from_diffusers_folder(folder, getattr(opts, "tokenizer_cache_dir", None),
                                            opts.init_seed if opts.from_scratch else None)
        if parts.pop("prediction_type", None) == "v_prediction" and not v_param:
            logger.warning("%s: its scheduler predicts v but --v_parameterization is not set; "
                           "training as epsilon-prediction as the flags say", path)
    if opts.from_scratch and kind in ("preset", "single_file"):  # (folders build it from config.json)
        parts["unet"] = scratch_denoiser(parts["unet"], opts.init_seed)
    v2 = is_v2(parts["unet"])
    if opts.v2 and not v2:
        logger.warning("%s is an SD 1.x model but --v2 is set: loading it as SD 1.x", path)
    if opts.vae:
        parts["vae"] = load_vae(opts.vae)
    for key, dtype in (("unet", opts.dtype), ("text_encoder", opts.dtype), ("vae", opts.vae_dtype)):
        if parts[key].dtype != dtype:  # diffusers warns on every .to(), even a no-op one
            parts[key].to(dtype=dtype)
    return Components(denoiser=parts["unet"], vae=parts["vae"], text_encoders=[parts["text_encoder"]],
                      tokenizers=[parts["tokenizer"]], v_parameterization=v_param, v2=v2,
                      model_path=path, vae_path=opts.vae)


def is_v2(unet) -> bool:
    """SD2 UNets project attention inputs with Linear layers; SD1 uses 1x1 convs."""
    return bool(unet.config.use_linear_projection)


def _check_sd_keys(checkpoint: Mapping[str, torch.Tensor], path: str) -> bool:
    """Return v2 for an SD1/SD2 checkpoint; ModelLoadError naming what was found otherwise."""
    keys = list(checkpoint)
    if any(k.startswith("conditioner.embedders.") for k in keys):
        raise ModelLoadError(f"{path}: this is an SDXL checkpoint (conditioner.embedders.* keys), "
                             "not SD 1.x/2.x; use the SDXL scripts")
    if any(k.startswith(("double_blocks.", "model.diffusion_model.double_blocks.")) for k in keys):
        raise ModelLoadError(f"{path}: this is a FLUX checkpoint (double_blocks.* keys), not SD 1.x/2.x")
    has_unet = ldm.UNET_PREFIX + "input_blocks.0.0.weight" in checkpoint
    sd1 = any(k.startswith(ldm.CLIP_L_PREFIX) for k in keys)
    sd2 = any(k.startswith(ldm.OPEN_CLIP_PREFIX) for k in keys)
    if not has_unet or not (sd1 or sd2) or not any(k.startswith(ldm.VAE_PREFIX) for k in keys):
        sample = ", ".join(keys[:3]) or "no tensors"
        raise ModelLoadError(f"{path}: not an SD 1.x/2.x checkpoint: expected model.diffusion_model.*, "
                             f"first_stage_model.* and cond_stage_model.* keys, found {sample}")
    return sd2


def infer_unet_config(ckpt: Mapping[str, torch.Tensor], v2: bool) -> dict:
    """UNet2DConditionModel kwargs read from the shapes of LDM UNet tensors."""
    p = ldm.UNET_PREFIX
    down_at = sorted(int(m[1]) for k in ckpt if (m := re.match(re.escape(p) + r"input_blocks\.(\d+)\.0\.op\.weight$", k)))
    if not down_at:
        raise ModelLoadError("checkpoint UNet has no downsampling blocks; not an SD 1.x/2.x UNet")
    layers = down_at[0] - 1
    per, n_blocks = layers + 1, len(down_at) + 1
    channels = tuple(ckpt[f"{p}input_blocks.{per * i + 1}.0.out_layers.3.weight"].shape[0] for i in range(n_blocks))
    down_attn = [f"{p}input_blocks.{per * i + 1}.1.proj_in.weight" in ckpt for i in range(n_blocks)]
    up_attn = [f"{p}output_blocks.{per * i}.1.proj_in.weight" in ckpt for i in range(n_blocks)]
    cross_dim = next(v.shape[1] for k, v in ckpt.items() if k.startswith(p) and k.endswith("attn2.to_k.weight"))
    return unet_config(v2, channels, cross_dim, layers_per_block=layers,
                       in_channels=ckpt[p + "input_blocks.0.0.weight"].shape[1],
                       down_block_types=tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in down_attn),
                       up_block_types=tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in up_attn))


def parts_from_checkpoint(checkpoint: Mapping[str, torch.Tensor], path: str,
                          tokenizer_cache_dir: Optional[str] = None) -> dict:
    """UNet, VAE, text encoder and tokenizer from one LDM-layout state dict."""
    UNet2DConditionModel = diffusers_class("UNet2DConditionModel")
    from transformers import CLIPTextConfig, CLIPTextModel

    checkpoint = ldm.normalize_checkpoint(checkpoint)
    v2 = _check_sd_keys(checkpoint, path)
    try:
        unet_kwargs = infer_unet_config(checkpoint, v2)
        unet = materialize(lambda: UNet2DConditionModel(**unet_kwargs),
                            lambda s: ldm.pull(checkpoint, ldm.unet_key_map(s, unet_kwargs["layers_per_block"]), s))
        vae = vae_from_ldm(checkpoint, ldm.VAE_PREFIX)
        vocab = _text_vocab_size(checkpoint, v2)
        tokenizer = find_tokenizer(v2, vocab, tokenizer_cache_dir, path)
        te_config = CLIPTextConfig(**infer_text_encoder_config(checkpoint, v2, tokenizer))
        if v2:
            pull_te = lambda s: ldm.pull_open_clip(checkpoint, s)  # noqa: E731
        else:
            pull_te = lambda s: ldm.pull(checkpoint, ldm.clip_l_key_map(s), s)  # noqa: E731
        text_encoder = materialize(lambda: CLIPTextModel(te_config), pull_te)
    except (ldm.LayoutError, ValueError, StopIteration) as e:
        raise ModelLoadError(f"{path}: SD checkpoint is incomplete or has unexpected shapes ({e})") from None
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}


def _text_vocab_size(checkpoint: Mapping[str, torch.Tensor], v2: bool) -> int:
    key = ldm.OPEN_CLIP_PREFIX + "token_embedding.weight" if v2 else \
        ldm.CLIP_L_PREFIX + "text_model.embeddings.token_embedding.weight"
    return checkpoint[key].shape[0]


def parts_from_diffusers_folder(folder: str, tokenizer_cache_dir: Optional[str] = None,
                                scratch_seed: Optional[int] = None) -> dict:
    """UNet, VAE, text encoder and tokenizer of a diffusers folder; also its scheduler's prediction type.
    `scratch_seed` (--from_scratch): the UNet is built from its config with weights drawn from it."""
    import json

    AutoencoderKL, UNet2DConditionModel = diffusers_classes("AutoencoderKL", "UNet2DConditionModel")
    from transformers import CLIPTextModel, CLIPTokenizer

    parts = load_folder_parts(folder, {"unet": UNet2DConditionModel, "vae": AutoencoderKL,
                                       "text_encoder": CLIPTextModel}, "SD",
                              scratch=None if scratch_seed is None else ("unet", scratch_seed))
    unet, text_encoder = parts["unet"], parts["text_encoder"]
    v2 = is_v2(unet)
    if os.path.isdir(os.path.join(folder, "tokenizer")):
        tokenizer = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")
    else:
        tokenizer = find_tokenizer(v2, text_encoder.config.vocab_size, tokenizer_cache_dir, folder)
    prediction_type = None
    scheduler_config = os.path.join(folder, "scheduler", "scheduler_config.json")
    if os.path.isfile(scheduler_config):
        with open(scheduler_config, encoding="utf-8") as f:
            prediction_type = json.load(f).get("prediction_type")
    return {**parts, "tokenizer": tokenizer, "prediction_type": prediction_type}


