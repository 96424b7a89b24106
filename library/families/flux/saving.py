"""What a FLUX.1 model is saved as: the BFL transformer file (as sd-scripts' flux_train.py saves: the
transformer alone, as flux1-dev.safetensors), the FluxPipeline folder, and for the tiny model the
clip_l / t5xxl / ae files that --clip_l / --t5xxl / --ae take. Writing is library/families/model_saving.py.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from torch import nn

from library.families.common import ldm_layout as ldm
from library.families import model_saving
from library.families.flux.layout import clip_l_to_file, diffusers_to_bfl
from library.families.common.t5 import t5_to_file
from library.families.flux.configs import build_flux_modules

# As FluxPipeline.save_pretrained writes it, without importing the pipeline.
_MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
}
# FLUX.1-dev's scheduler settings (dynamic shifting by image size).
_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                  base_image_seq_len=256, max_image_seq_len=4096)
PART_NAMES = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


def pipeline_folder(parts: Mapping[str, Any]) -> tuple[dict, dict]:
    """The parts and model_index.json of a folder the Flux loader and diffusers' FluxPipeline read."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    model_index = {**_MODEL_INDEX, "_diffusers_version": diffusers.__version__}
    return {**{n: parts[n] for n in PART_NAMES}, "scheduler": FlowMatchEulerDiscreteScheduler(**_SCHEDULER)}, model_index


def bfl_tensors(transformer: nn.Module) -> dict[str, Any]:
    """The transformer in the BFL single-file layout (keys without prefix; fused tensors Deferred).

    CLIP-L, T5 and the AE are not part of such a file; load it back with --clip_l / --t5xxl / --ae.
    """
    return diffusers_to_bfl(transformer.state_dict(), lazy=True)


# File names that sd-scripts' Flux docs use for the separate parts.
COMPONENT_FILES = {"clip_l": "clip_l.safetensors", "t5xxl": "t5xxl.safetensors", "ae": "ae.safetensors"}


def save_flux_component_files(parts: dict, folder: str) -> dict[str, str]:
    """Write CLIP-L, T5 and the AE as the separate files --clip_l / --t5xxl / --ae take; {flag: path}."""
    vae_state = parts["vae"].state_dict()
    states = {"clip_l": clip_l_to_file(parts["text_encoder"].state_dict()),
              "t5xxl": t5_to_file(parts["text_encoder_2"].state_dict()),
              "ae": ldm.push(vae_state, ldm.vae_key_map(vae_state.keys(), ""))}
    written = {}
    for flag, state in states.items():
        written[flag] = os.path.join(folder, COMPONENT_FILES[flag])
        model_saving.write_single_file(state, written[flag], "safetensors", metadata=model_saving.SAFETENSORS_METADATA)
    return written


def write_flux_preset(preset: str, out: str, single_file: bool = False) -> dict[str, str]:
    """Build a preset ("tiny:flux") and write it: a diffusers folder, or with `single_file` the BFL transformer
    plus clip_l / t5xxl / ae files next to it. `out` is then a .safetensors name or a folder (which gets
    flux1-tiny.safetensors). Returns {"transformer" | "clip_l" | "t5xxl" | "ae" | "folder": path}."""
    parts = build_flux_modules(preset)
    if not single_file:
        model_saving.write_pipeline_folder(*pipeline_folder(parts), out)
        return {"folder": out}
    transformer_path = out if out.lower().endswith(".safetensors") else os.path.join(out, "flux1-tiny.safetensors")
    folder = os.path.dirname(os.path.abspath(transformer_path))
    os.makedirs(folder, exist_ok=True)
    model_saving.write_single_file(bfl_tensors(parts["transformer"]), transformer_path, "safetensors",
                                   metadata=model_saving.SAFETENSORS_METADATA)
    return {"transformer": transformer_path, **save_flux_component_files(parts, folder)}
