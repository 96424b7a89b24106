"""What an SD3 model is saved as: the SAI single file (MMDiT, VAE and the three text encoders in one file, as
sd3_medium_incl_clips_t5xxlfp16.safetensors; the loaders of sd-scripts, ComfyUI and diffusers read it), the
StableDiffusion3Pipeline folder, and for the tiny model also the MMDiT + VAE file with separate
clip_l / clip_g / t5xxl files (the sd3.5_large.safetensors layout). Writing is library/families/model_saving.py.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from torch import nn

from library.families.common import ldm_layout as ldm
from library.families import model_saving
from library.families.sd3 import layout as sai
from library.families.common.t5 import t5_to_file
from library.families.sd3.configs import build_sd3_modules

_MODEL_INDEX = {
    "_class_name": "StableDiffusion3Pipeline",
    "feature_extractor": [None, None], "image_encoder": [None, None],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_3": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "tokenizer_3": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
}
PART_NAMES = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
              "tokenizer_3")


def pipeline_folder(parts: Mapping[str, Any]) -> tuple[dict, dict]:
    """The parts and model_index.json of a folder that the SD3 loader and StableDiffusion3Pipeline read.

    The transformer must be in diffusers' order while it is written (sd3/layout.py diffusers_order)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    model_index = {**_MODEL_INDEX, "_diffusers_version": diffusers.__version__}
    return {**{n: parts[n] for n in PART_NAMES},
            "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)}, model_index


def mmdit_tensors(transformer: nn.Module) -> dict[str, Any]:
    """The MMDiT in the SAI layout under `model.diffusion_model.` (fused tensors Deferred)."""
    state = sai.diffusers_to_sai(sai.diffusers_state_dict(transformer), lazy=True)
    return {sai.SAI_PREFIX + k: v for k, v in state.items()}


def vae_tensors(vae: nn.Module, prefix: str = sai.VAE_PREFIX) -> dict[str, Any]:
    state = vae.state_dict()
    return ldm.push(state, ldm.vae_key_map(state.keys(), prefix))


def clip_file_tensors(text_encoder: nn.Module) -> dict[str, Any]:
    """A CLIPTextModelWithProjection as clip_l.safetensors / clip_g.safetensors hold it (`text_model.*`, `text_projection.weight`)."""
    return {k: v for k, v in text_encoder.state_dict().items() if not k.endswith("position_ids")}


def single_file_tensors(parts: Mapping[str, nn.Module], with_text_encoders: bool = True) -> dict[str, Any]:
    """The SAI all-in-one layout: MMDiT, VAE and (with_text_encoders) CLIP-L, CLIP-G and T5."""
    out = {**mmdit_tensors(parts["transformer"]), **vae_tensors(parts["vae"])}
    if with_text_encoders:
        for which, part in (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2")):
            prefix = sai.TEXT_ENCODER_PREFIXES[which]
            out.update({prefix + k: v for k, v in clip_file_tensors(parts[part]).items()})
        prefix = sai.TEXT_ENCODER_PREFIXES["t5xxl"]
        out.update({prefix + k: v for k, v in t5_to_file(parts["text_encoder_3"].state_dict()).items()})
    return out


COMPONENT_FILES = {"clip_l": "clip_l.safetensors", "clip_g": "clip_g.safetensors", "t5xxl": "t5xxl.safetensors"}


def write_sd3_preset(preset: str, out: str, layout: str = "diffusers", parts: Optional[dict] = None) -> dict[str, str]:
    """Build a preset ("tiny:sd3") and write it in one on-disk layout:

    - "diffusers": a StableDiffusion3Pipeline folder at `out`;
    - "single_file": the SAI all-in-one file (`out` a .safetensors name, or a folder that gets sd3-tiny.safetensors);
    - "separate": the MMDiT + VAE file plus clip_l / clip_g / t5xxl files beside it.

    `parts`: the preset's modules when already built (build_sd3_modules). Returns {"folder" | "model" |
    "clip_l" | "clip_g" | "t5xxl": path}.
    """
    parts = parts or build_sd3_modules(preset)
    if layout == "diffusers":
        model_saving.write_pipeline_folder(*pipeline_folder(parts), out)
        return {"folder": out}
    if layout not in ("single_file", "separate"):
        raise ValueError(f"layout: expected diffusers, single_file or separate, got {layout!r}")
    model_path = out if out.lower().endswith(".safetensors") else os.path.join(out, "sd3-tiny.safetensors")
    folder = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(folder, exist_ok=True)
    model_saving.write_single_file(single_file_tensors(parts, layout == "single_file"), model_path, "safetensors",
                                   metadata=model_saving.SAFETENSORS_METADATA)
    written = {"model": model_path}
    if layout == "separate":
        states = {"clip_l": clip_file_tensors(parts["text_encoder"]),
                  "clip_g": clip_file_tensors(parts["text_encoder_2"]),
                  "t5xxl": t5_to_file(parts["text_encoder_3"].state_dict())}
        for flag, state in states.items():
            written[flag] = os.path.join(folder, COMPONENT_FILES[flag])
            model_saving.write_single_file(state, written[flag], "safetensors",
                                           metadata=model_saving.SAFETENSORS_METADATA)
    return written
