"""What an SD 1.x / 2.x model is saved as: the LDM single-file layout and the StableDiffusionPipeline folder.

The writing itself (formats, dtype, atomic files and folders) is library/families/model_saving.py.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from library.families.common import ldm_layout as ldm
from library.families import model_saving
from library.families.sd.configs import PRESETS
from library.families.sd.configs import build_sd_modules

# The training noise schedule of every SD 1.x / 2.x model (scaled_linear, 0.00085 .. 0.012, 1000 steps).
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1)


def pipeline_folder(unet: nn.Module, vae: nn.Module, text_encoder: nn.Module, tokenizer,
                    v_parameterization: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parts and model_index.json of a folder StableDiffusionPipeline.from_pretrained loads offline."""
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
    return parts, model_index


def ldm_tensors(unet: nn.Module, vae: nn.Module, text_encoder: nn.Module, v2: bool) -> dict[str, Any]:
    """The three parts as one LDM-layout state dict of the models' own tensors (renamed; fused ones Deferred)."""
    layers = unet.config.layers_per_block
    return ldm.diffusers_to_ldm(unet.state_dict(), vae.state_dict(), text_encoder.state_dict(), v2, layers, lazy=True)


def ldm_state_dict(unet: nn.Module, vae: nn.Module, text_encoder: nn.Module, v2: bool,
                   dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """ldm_tensors on the CPU (optionally cast to `dtype`), for building checkpoints in memory."""
    from library.core.safetensors_io import prepared

    return {k: prepared(v, dtype) for k, v in ldm_tensors(unet, vae, text_encoder, v2).items()}


def write_preset(preset: str, out: str, single_file: bool = False) -> None:
    """Build a preset ("tiny:sd1", ...) and write it as a diffusers folder or one LDM-layout file."""
    p = build_sd_modules(preset)
    if single_file:
        fmt = model_saving.format_of_path(out)
        model_saving.write_single_file(ldm_tensors(p["unet"], p["vae"], p["text_encoder"], PRESETS[preset].v2), out,
                                       "ckpt" if fmt == "ckpt" else "safetensors")
    else:
        parts, index = pipeline_folder(p["unet"], p["vae"], p["text_encoder"], p["tokenizer"],
                                       PRESETS[preset].v_parameterization)
        model_saving.write_pipeline_folder(parts, index, out)
