"""Write an SD 1.x / 2.x model as a diffusers folder or as one LDM-layout `.safetensors` / `.ckpt` file.

Both writers are atomic: the output appears complete under its final name or not at all.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from library.core.io_utils import atomic_directory, atomic_path, save_safetensors_atomic
from library.families import ldm_layout as ldm
from library.families.sd_configs import PRESETS
from library.families.tiny import build_sd_modules

# The training noise schedule of every SD 1.x / 2.x model (scaled_linear, 0.00085 .. 0.012, 1000 steps).
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1)


def save_diffusers_folder(unet: nn.Module, vae: nn.Module, text_encoder: nn.Module, tokenizer, out_dir: str,
                          v_parameterization: bool = False) -> None:
    """Write a folder that diffusers' StableDiffusionPipeline.from_pretrained loads offline.

    The folder is written beside `out_dir` under a temporary name and renamed into
    place; an existing `out_dir` is replaced only after the new one is complete.
    """
    import diffusers
    from diffusers import PNDMScheduler

    scheduler = PNDMScheduler(**SCHEDULER_CONFIG,
                              prediction_type="v_prediction" if v_parameterization else "epsilon")
    # model_index.json as StableDiffusionPipeline.save_pretrained writes it; importing the
    # pipeline classes just to save would cost seconds.
    model_index = {
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None], "image_encoder": [None, None], "requires_safety_checker": False,
        "safety_checker": [None, None], "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
    }
    parts = {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler}
    write_diffusers_folder(parts, model_index, out_dir)


def write_diffusers_folder(parts: dict, model_index: dict, out_dir: str) -> None:
    """Save each part (`save_pretrained`) into its subfolder plus model_index.json, atomically.

    The folder is written beside `out_dir` under a temporary name and renamed into
    place; an existing `out_dir` is replaced only after the new one is complete.
    """
    with atomic_directory(out_dir) as tmp:
        for sub, part in parts.items():
            part.save_pretrained(os.path.join(tmp, sub))
        with open(os.path.join(tmp, "model_index.json"), "w", encoding="utf-8") as f:
            json.dump(model_index, f, indent=2)


def ldm_state_dict(unet: nn.Module, vae: nn.Module, text_encoder: nn.Module, v2: bool,
                   dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The three parts as one LDM-layout state dict (optionally cast to `dtype`)."""
    layers = unet.config.layers_per_block
    state = ldm.diffusers_to_ldm(unet.state_dict(), vae.state_dict(), text_encoder.state_dict(), v2, layers)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def save_single_file(unet: nn.Module, vae: nn.Module, text_encoder: nn.Module, path: str, v2: bool,
                     dtype: Optional[torch.dtype] = None) -> None:
    """Write an LDM-layout checkpoint: `.safetensors`, or a torch pickle `{"state_dict": ...}` otherwise."""
    state = ldm_state_dict(unet, vae, text_encoder, v2, dtype)
    if path.lower().endswith(".safetensors"):
        save_safetensors_atomic(state, path)
    else:
        with atomic_path(path) as tmp:
            torch.save({"state_dict": state}, tmp)


def write_preset(preset: str, out: str, single_file: bool = False) -> None:
    """Build a preset ("tiny:sd1", ...) and write it as a diffusers folder or one LDM-layout file."""
    parts = build_sd_modules(preset)
    if single_file:
        save_single_file(parts["unet"], parts["vae"], parts["text_encoder"], out, PRESETS[preset].v2)
    else:
        save_diffusers_folder(parts["unet"], parts["vae"], parts["text_encoder"], parts["tokenizer"], out,
                              PRESETS[preset].v_parameterization)
