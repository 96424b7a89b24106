"""Qwen-Image's DiT file layouts.

The DiT: Qwen's own checkpoint (Qwen/Qwen-Image transformer/) already uses diffusers' module names, and ComfyUI's
single files (Comfy-Org/Qwen-Image_ComfyUI split_files/diffusion_models/qwen_image_bf16.safetensors;
comfy/ldm/qwen_image/model.py) keep them, with `model.diffusion_model.` in front in whole-model files. ComfyUI's
LastLayer holds (scale, shift) as diffusers' AdaLayerNormContinuous does, so no tensor changes.

LoRA names and file layouts: lora_names.py.
"""

from __future__ import annotations

from typing import Mapping

import torch

COMFY_PREFIX = "model.diffusion_model."


def strip_prefix(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DiT state dict without ComfyUI's whole-model prefix."""
    if any(k.startswith(COMFY_PREFIX) for k in tensors):
        return {k[len(COMFY_PREFIX):]: v for k, v in tensors.items() if k.startswith(COMFY_PREFIX)}
    return dict(tensors)


