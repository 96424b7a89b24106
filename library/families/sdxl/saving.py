"""What an SDXL model is saved as: the SGM single-file layout and the StableDiffusionXLPipeline folder.

The writing itself (formats, dtype, atomic files and folders) is library/families/model_saving.py.
"""

from __future__ import annotations

from typing import Any, Mapping


from library.families import model_saving
from library.families.sdxl import layout as sgm
from library.families.sdxl.configs import build_sdxl_modules

# SDXL base's training schedule (scaled_linear 0.00085 .. 0.012, 1000 steps) as its EulerDiscrete scheduler.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        steps_offset=1, timestep_spacing="leading")
PART_NAMES = ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


def pipeline_folder(parts: Mapping[str, Any], v_parameterization: bool = False) -> tuple[dict, dict]:
    """The parts and model_index.json of a folder StableDiffusionXLPipeline.from_pretrained loads offline;
    `parts` as build_sdxl_modules returns them."""
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
    return {**{n: parts[n] for n in PART_NAMES}, "scheduler": scheduler}, model_index


def sgm_tensors(parts: Mapping[str, Any]) -> dict[str, Any]:
    """The four models as one SGM-layout state dict of their own tensors (renamed; fused ones Deferred)."""
    unet = parts["unet"]
    return sgm.diffusers_to_sgm(unet.state_dict(), parts["vae"].state_dict(), parts["text_encoder"].state_dict(),
                                parts["text_encoder_2"].state_dict(), unet.config.layers_per_block, lazy=True)


def write_sdxl_preset(preset: str, out: str, single_file: bool = False) -> None:
    """Build an SDXL preset ("tiny:sdxl") and write it as a diffusers folder or one SGM file."""
    parts = build_sdxl_modules(preset)
    if single_file:
        fmt = "ckpt" if model_saving.format_of_path(out) == "ckpt" else "safetensors"
        model_saving.write_single_file(sgm_tensors(parts), out, fmt)
    else:
        model_saving.write_pipeline_folder(*pipeline_folder(parts), out)
