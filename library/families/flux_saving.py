"""Writing a FLUX.1 model: a diffusers folder, or BFL single files (the transformer as flux1-dev.safetensors,
plus clip_l / t5xxl / ae files for the tiny model). Every file is written atomically."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from library.core.errors import UserError
from library.core.io_utils import save_safetensors_atomic
from library.families import ldm_layout as ldm
from library.families.flux_bfl_layout import (
    clip_l_to_file,
    diffusers_to_bfl,
    t5_to_file,
)
from library.families.flux_configs import build_flux_modules
from library.families.sd_saving import write_diffusers_folder

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


def save_flux_diffusers_folder(parts: dict, out_dir: str) -> None:
    """A folder the Flux loader (and diffusers' FluxPipeline) reads; written atomically."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    names = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    model_index = {**_MODEL_INDEX, "_diffusers_version": diffusers.__version__}
    write_diffusers_folder({**{n: parts[n] for n in names}, "scheduler": FlowMatchEulerDiscreteScheduler(**_SCHEDULER)},
                           model_index, out_dir)


def _plain(state: dict, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    # safetensors wants contiguous CPU tensors; none of these share storage (fused rows are concatenated anew)
    return {k: (v if dtype is None else v.to(dtype)).detach().cpu().contiguous() for k, v in state.items()}


def save_flux_bfl_file(transformer: nn.Module, path: str, dtype: Optional[torch.dtype] = None) -> None:
    """Write only the transformer, in the BFL single-file layout of flux1-dev.safetensors (keys without prefix).

    CLIP-L, T5 and the AE are not part of such a file; load it back with --clip_l / --t5xxl / --ae.
    """
    if not path.lower().endswith(".safetensors"):
        raise UserError(f"{path}: a FLUX.1 single file is written as .safetensors only (or give a folder "
                        "for a diffusers folder)")
    save_safetensors_atomic(_plain(diffusers_to_bfl(transformer.state_dict()), dtype), path, {"format": "pt"})


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
        save_safetensors_atomic(_plain(state), written[flag], {"format": "pt"})
    return written


def write_flux_preset(preset: str, out: str, single_file: bool = False) -> dict[str, str]:
    """Build a preset ("tiny:flux") and write it: a diffusers folder, or with `single_file` the BFL transformer
    plus clip_l / t5xxl / ae files next to it. `out` is then a .safetensors name or a folder (which gets
    flux1-tiny.safetensors). Returns {"transformer" | "clip_l" | "t5xxl" | "ae" | "folder": path}."""
    parts = build_flux_modules(preset)
    if not single_file:
        save_flux_diffusers_folder(parts, out)
        return {"folder": out}
    transformer_path = out if out.lower().endswith(".safetensors") else os.path.join(out, "flux1-tiny.safetensors")
    folder = os.path.dirname(os.path.abspath(transformer_path))
    os.makedirs(folder, exist_ok=True)
    save_flux_bfl_file(parts["transformer"], transformer_path)
    return {"transformer": transformer_path, **save_flux_component_files(parts, folder)}
