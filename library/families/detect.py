"""Which family a model path belongs to, from cheap evidence: preset names, a diffusers folder's
model_index.json, or the tensor names in a .safetensors header (no weights are read)."""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

from library.families.anima import configs as anima_configs

from library.families.chroma import configs as chroma_configs

from library.families.flux import configs as flux_configs

from library.families.hunyuan_image import configs as hunyuan_image_configs

from library.families.lumina import configs as lumina_configs

from library.families.sd3 import configs as sd3_configs

from library.families.sd import configs as sd_configs

from library.families.sdxl import configs as sdxl_configs

# Key prefixes that only one family's single-file checkpoints carry, most specific first.
_SINGLE_FILE_MARKERS = (
    ("net.blocks.0.self_attn.", "anima"),  # Anima / Cosmos-Predict2 DiT (MiniTrainDIT under net.)
    ("model.diffusion_model.net.blocks.0.self_attn.", "anima"),  # ComfyUI's whole-model Anima file
    ("layers.0.attention.qkv.", "lumina"),  # Lumina Image 2.0 NextDiT
    ("model.diffusion_model.layers.0.attention.qkv.", "lumina"),  # ComfyUI's whole-model Lumina file
    ("double_blocks.0.img_attn_qkv.", "hunyuan_image"),  # HunyuanImage 2.1 DiT (FLUX.1's is img_attn.qkv)
    ("model.diffusion_model.double_blocks.0.img_attn_qkv.", "hunyuan_image"),
    ("conditioner.embedders.", "sdxl"),
    ("distilled_guidance_layer.", "chroma"),  # Chroma: FLUX.1's blocks plus the approximator
    ("model.diffusion_model.distilled_guidance_layer.", "chroma"),
    ("double_blocks.", "flux"),
    ("model.diffusion_model.double_blocks.", "flux"),
    ("model.diffusion_model.joint_blocks.", "sd3"),
    ("joint_blocks.", "sd3"),
    ("model.diffusion_model.", "sd"),
)


def _preset_family(path: str) -> Optional[str]:
    for name, presets in (("sd", sd_configs.PRESETS), ("sdxl", sdxl_configs.PRESETS), ("flux", flux_configs.PRESETS),
                          ("chroma", chroma_configs.PRESETS),
                          ("anima", anima_configs.PRESETS), ("sd3", sd3_configs.PRESETS),
                          ("lumina", lumina_configs.PRESETS), ("hunyuan_image", hunyuan_image_configs.PRESETS)):
        if path in presets:
            return name
    return None


def _folder_family(path: str) -> Optional[str]:
    try:
        with open(os.path.join(path, "model_index.json"), encoding="utf-8") as f:
            cls = json.load(f).get("_class_name", "")
    except (OSError, ValueError):
        return None
    if "Flux" in cls:
        return "flux"
    if "StableDiffusion3" in cls:
        return "sd3"
    if "XL" in cls:
        return "sdxl"
    return "sd" if "StableDiffusion" in cls else None


def _file_family(path: str) -> Optional[str]:
    if not path.lower().endswith(".safetensors"):
        return None  # a pickle cannot be inspected without loading it
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - not a readable safetensors file: let the loader say why
        return None
    found = {family for prefix, family in _SINGLE_FILE_MARKERS if any(k.startswith(prefix) for k in keys)}
    for _, family in _SINGLE_FILE_MARKERS:  # the most specific marker wins (SDXL files also have the SD one)
        if family in found:
            return family
    return None


# What a single file's tensor names say it holds, most specific first (for "expected X, found Y" errors).
_CONTENTS = (
    ("byt5_in.", "a HunyuanImage 2.1 DiT"),
    ("model.diffusion_model.byt5_in.", "a HunyuanImage 2.1 DiT"),
    ("model.layers.0.self_attn.q_proj.bias", "a Qwen2.5-VL text encoder"),
    ("net.blocks.", "an Anima DiT"),
    ("cap_embedder.", "a Lumina Image 2.0 DiT"),
    ("model.diffusion_model.cap_embedder.", "a Lumina Image 2.0 DiT"),
    ("model.layers.0.post_feedforward_layernorm.", "a Gemma-2 text encoder"),
    ("model.layers.", "a Qwen3 text encoder"),
    ("conditioner.embedders.", "an SDXL checkpoint"),
    ("distilled_guidance_layer.", "a Chroma transformer"),
    ("double_blocks.", "a FLUX.1 transformer"),
    ("model.diffusion_model.double_blocks.", "a FLUX.1 transformer"),
    ("model.diffusion_model.joint_blocks.", "an SD3 checkpoint"),
    ("joint_blocks.", "an SD3 MMDiT"),
    ("model.diffusion_model.input_blocks.", "an SD 1.x/2.x checkpoint"),
    ("lora_", "a LoRA"),
    ("encoder.block.", "a T5 text encoder"),
    ("text_model.encoder.layers.", "a CLIP text encoder"),
    ("encoder.layers.", "a CLIP text encoder"),
    ("encoder.conv_in.", "an autoencoder"),
    ("first_stage_model.", "an autoencoder"),
)


def describe_keys(keys: Iterable[str]) -> str:
    """What a checkpoint's tensor names say it holds ("a T5 text encoder", "an SDXL checkpoint", ...)."""
    keys = list(keys)
    for prefix, what in _CONTENTS:
        if any(k.startswith(prefix) for k in keys):
            return what
    return f"unrecognised tensors ({', '.join(keys[:3]) or 'none'})"


def detect_family(path: str) -> Optional[str]:
    """"sd", "sdxl", "flux", "chroma", "sd3", "anima", "lumina", "hunyuan_image", or None when the path does not tell
    (then the caller's default applies)."""
    if path.startswith(("tiny:", "random:")):
        return _preset_family(path)
    if os.path.isdir(path):
        return _folder_family(path)
    if os.path.isfile(path):
        return _file_family(path)
    return None
