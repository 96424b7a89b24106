"""Qwen-Image's DiT file layouts.

The DiT: Qwen's own checkpoint (Qwen/Qwen-Image transformer/) already uses diffusers' module names, and ComfyUI's
single files (Comfy-Org/Qwen-Image_ComfyUI split_files/diffusion_models/qwen_image_bf16.safetensors;
comfy/ldm/qwen_image/model.py) keep them, with `model.diffusion_model.` in front in whole-model files. ComfyUI's
LastLayer holds (scale, shift) as diffusers' AdaLayerNormContinuous does, so no tensor changes.

LoRA names and file layouts: lora_names.py.
"""

from library.families.common.dit_layout import COMFY_PREFIX, strip_prefix  # noqa: F401 (the shared DiT rules)
