"""Write an SDXL model as a diffusers folder or as one SGM-layout `.safetensors` file (both atomic)."""

from __future__ import annotations

from typing import Optional

import torch

from library.core.io_utils import atomic_path, save_safetensors_atomic
from library.families import sgm_layout as sgm
from library.families.sd_saving import write_diffusers_folder
from library.families.sdxl_configs import build_sdxl_modules

# SDXL base's training schedule (scaled_linear 0.00085 .. 0.012, 1000 steps) as its EulerDiscrete scheduler.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        steps_offset=1, timestep_spacing="leading")


def save_sdxl_diffusers_folder(parts: dict, out_dir: str, v_parameterization: bool = False) -> None:
    """A folder StableDiffusionXLPipeline.from_pretrained loads offline; `parts` as build_sdxl_modules returns."""
    import diffusers
    from diffusers import EulerDiscreteScheduler

    scheduler = EulerDiscreteScheduler(**SCHEDULER_CONFIG,
                                       prediction_type="v_prediction" if v_parameterization else "epsilon")
    # As StableDiffusionXLPipeline.save_pretrained writes it, without importing the pipeline.
    model_index = {
        "_class_name": "StableDiffusionXLPipeline", "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None], "image_encoder": [None, None], "force_zeros_for_empty_prompt": True,
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
    }
    names = ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    write_diffusers_folder({**{n: parts[n] for n in names}, "scheduler": scheduler}, model_index, out_dir)


def sgm_state_dict(parts: dict, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The four models as one SGM-layout state dict (optionally cast to `dtype`), on the CPU."""
    unet = parts["unet"]
    state = sgm.diffusers_to_sgm(unet.state_dict(), parts["vae"].state_dict(), parts["text_encoder"].state_dict(),
                                 parts["text_encoder_2"].state_dict(), unet.config.layers_per_block)
    return {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in state.items()}


def save_sdxl_single_file(parts: dict, path: str, dtype: Optional[torch.dtype] = None) -> None:
    """Write an SGM-layout checkpoint: `.safetensors`, or a torch pickle `{"state_dict": ...}` otherwise."""
    state = sgm_state_dict(parts, dtype)
    if path.lower().endswith(".safetensors"):
        save_safetensors_atomic(state, path)
    else:
        with atomic_path(path) as tmp:
            torch.save({"state_dict": state}, tmp)


def write_sdxl_preset(preset: str, out: str, single_file: bool = False) -> None:
    """Build an SDXL preset ("tiny:sdxl") and write it as a diffusers folder or one SGM file."""
    parts = build_sdxl_modules(preset)
    if single_file:
        save_sdxl_single_file(parts, out)
    else:
        save_sdxl_diffusers_folder(parts, out)
