"""Qwen-Image's LoRA names and the LoRA file layouts it reads.

- kohya / musubi-tuner (networks.lora_qwen_image): `lora_unet_<diffusers path with _>.lora_down.weight` / `lora_up` /
  `alpha`; ComfyUI maps `lora_unet_` names onto `diffusion_model.<path>` (comfy/lora.py model_lora_keys_unet);
- ComfyUI's own names `diffusion_model.<path>.lora_down.weight` (and the diffusers prefix `transformer.`);
- ai-toolkit / diffusers PEFT: `diffusion_model.<path>.lora_A.weight` / `lora_B.weight` (or `transformer.`), the
  scale in `alpha` when present, else 1 (alpha = rank).
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

LORA_PREFIX = "lora_unet_"
_FILE_PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.")
# Identifiers with underscores in Qwen-Image's module paths, so that a kohya name can be dotted again.
_WORDS = ("transformer_blocks", "img_mod", "txt_mod", "img_mlp", "txt_mlp", "to_q", "to_k", "to_v", "to_out",
          "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "img_in", "txt_in", "txt_norm", "norm_out",
          "proj_out", "time_text_embed", "timestep_embedder", "linear_1", "linear_2", "norm_q", "norm_k",
          "norm_added_q", "norm_added_k", "img_norm1", "img_norm2", "txt_norm1", "txt_norm2")


def dotted(underscored: str) -> str:
    """`transformer_blocks_0_attn_to_out_0` -> `transformer_blocks.0.attn.to_out.0` (the longest known word wins)."""
    parts, rest = [], underscored
    while rest:
        for word in sorted(_WORDS, key=len, reverse=True):
            if rest == word or rest.startswith(word + "_"):
                parts.append(word)
                rest = rest[len(word) + 1:]
                break
        else:
            head, _, rest = rest.partition("_")
            parts.append(head)
    return ".".join(parts)


def kohya_name(path: str) -> str:
    """diffusers module path -> kohya LoRA module name."""
    return LORA_PREFIX + path.replace(".", "_")


def _module_of(key: str) -> tuple[str, str] | None:
    """(module path, suffix) of a LoRA key in ComfyUI / PEFT form, or None."""
    m = re.match(r"^(?:%s)(.+)\.(lora_A\.weight|lora_B\.weight|lora_down\.weight|lora_up\.weight|alpha|dora_scale)$"
                 % "|".join(re.escape(p) for p in _FILE_PREFIXES), key)
    return (m[1], m[2]) if m else None


def to_kohya_lora(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen-Image LoRA in ComfyUI's / ai-toolkit's / diffusers' names -> kohya names (lora_down / lora_up /
    alpha); a file already in kohya names comes back as it is. PEFT files without alpha get alpha = rank (scale 1)."""
    if not any(_module_of(k) for k in state):
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for key, value in state.items():
        hit = _module_of(key)
        if hit is None:
            out[key] = value
            continue
        path, suffix = hit
        name = kohya_name(path)
        suffix = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}.get(suffix, suffix)
        out[f"{name}.{suffix}"] = value
        if suffix == "lora_down.weight":
            ranks[name] = value.shape[0]
    for name, rank in ranks.items():
        out.setdefault(f"{name}.alpha", torch.tensor(float(rank)))
    return out


def to_comfy_lora(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kohya names -> ComfyUI's `diffusion_model.<path>.lora_down.weight` names (ComfyUI loads both)."""
    out = {}
    for key, value in state.items():
        name, dot, rest = key.partition(".")
        out[("diffusion_model." + dotted(name[len(LORA_PREFIX):]) if name.startswith(LORA_PREFIX) else name)
            + dot + rest] = value
    return out
