"""Qwen-Image's saved files: the DiT as one .safetensors in the names ComfyUI and musubi-tuner load (diffusers'
module names, no prefix: Comfy-Org's split_files/diffusion_models layout)."""

from __future__ import annotations

import torch


def dit_file_tensors(transformer) -> dict[str, torch.Tensor]:
    """A QwenImageTransformer2DModel's tensors as ComfyUI's qwen_image_bf16.safetensors holds them."""
    return dict(transformer.state_dict())
