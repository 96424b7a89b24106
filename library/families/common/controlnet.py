"""ControlNet files shared by the families that train one (SD 1.x/2.x, SDXL: diffusers `ControlNetModel`; FLUX.1:
`FluxControlNetModel`): a diffusers folder, or one .safetensors file with the diffusers tensor names.

ComfyUI's ControlNet loader (comfy/controlnet.py) reads both single-file layouts by their keys: a file with
`controlnet_cond_embedding.conv_in.weight` is a diffusers SD/SDXL ControlNet (it converts the names itself), one
with `controlnet_x_embedder.weight` an InstantX-style FLUX.1 ControlNet, which is what diffusers' FluxControlNetModel
is. So the single file is the model's own state dict, as sd-scripts writes it.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
from torch import nn

from library.core.errors import UserError
from library.core.io_utils import atomic_directory
from library.core.safetensors_io import write_safetensors
from library.families.model_saving import check_save_format, write_model_folder

CONTROLNET_FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")


def save_controlnet_files(controlnet: nn.Module, path: str, fmt: str, dtype: Optional[torch.dtype],
                          metadata: Optional[dict[str, str]]) -> str:
    """A diffusers folder (config.json + weights, what `from_pretrained` reads) or one .safetensors file; atomic."""
    check_save_format(fmt, CONTROLNET_FORMATS, "ControlNet", path)
    if fmt == "safetensors":
        return write_safetensors(controlnet.state_dict(), path, metadata, dtype)
    with atomic_directory(path) as tmp:
        write_model_folder(controlnet, tmp, fmt == "diffusers_safetensors", dtype)
    return path


def load_controlnet_weights(cls, path: str, make_fresh: Callable[[], nn.Module]) -> nn.Module:
    """`cls.from_pretrained(path)` of a diffusers folder, or `make_fresh()` (a ControlNet built from the base model,
    so of its shapes) with a single file's weights; a file of other shapes or names is a one-line error."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"--controlnet_model_name_or_path {path}: no config.json in the folder (expected a "
                            "diffusers ControlNet folder or a .safetensors file)")
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            name = json.load(f).get("_class_name")
        if name != cls.__name__:
            raise UserError(f"--controlnet_model_name_or_path {path}: a {name} folder, expected a {cls.__name__}")
        return cls.from_pretrained(path, torch_dtype=torch.float32)
    if not os.path.isfile(path):
        raise UserError(f"--controlnet_model_name_or_path {path}: not found")
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except Exception as e:  # a truncated or foreign file
        raise UserError(f"--controlnet_model_name_or_path {path}: not a readable .safetensors file ({e})") from None
    fresh = make_fresh()
    own = fresh.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        first = (missing or unexpected or wrong)[0]
        raise UserError(f"--controlnet_model_name_or_path {path}: not a ControlNet of this model ({len(missing)} "
                        f"tensors missing, {len(unexpected)} unexpected, {len(wrong)} of other shapes; e.g. {first})")
    fresh.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return fresh
