"""Anima LoRA files between sd-scripts' kohya names and ComfyUI's layout (sd-scripts' convert_anima_lora_to_comfy.py).

kohya: `lora_unet_<original DiT path with . -> _>` and `lora_te_<Qwen3 path>` with lora_down / lora_up / alpha.
ComfyUI: `diffusion_model.<original DiT path>.lora_A.weight` / `.lora_B.weight` / `.alpha` and
`text_encoders.qwen3_06b.transformer.model.<Qwen3 path>...` (ComfyUI reads the DiT modules in either layout,
Qwen3's only in this one). The tensors are the same; only the names change. An underscore name is turned
back into a dotted path by joining the known multi-word parts of Anima's and Qwen3's module names.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

COMFY_DIT_PREFIX = "diffusion_model."
COMFY_QWEN3_PREFIX = "text_encoders.qwen3_06b.transformer.model."
_KOHYA_PREFIXES = {"lora_unet_": COMFY_DIT_PREFIX, "lora_te_": COMFY_QWEN3_PREFIX}
_WEIGHTS = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight", "alpha": "alpha"}
# Module-name parts that hold an underscore, longest first (MiniTrainDIT, the LLM adapter, Qwen3).
_PARTS = sorted((
    "adaln_modulation_self_attn", "adaln_modulation_cross_attn", "adaln_modulation_mlp", "adaln_modulation",
    "self_attn", "cross_attn", "q_proj", "k_proj", "v_proj", "o_proj", "output_proj", "x_embedder", "t_embedder",
    "final_layer", "llm_adapter", "linear_1", "linear_2", "gate_proj", "up_proj", "down_proj", "out_proj",
), key=len, reverse=True)
# Names only Anima's kohya files have: its DiT blocks, LLM adapter and Qwen3 layers.
ANIMA_NAME = re.compile(r"^lora_(unet_(blocks_\d+_(self_attn|cross_attn|mlp|adaln)_|llm_adapter_)|te_layers_\d+_)")


def dotted(name: str) -> str:
    """`blocks_0_self_attn_q_proj` -> `blocks.0.self_attn.q_proj` (the known parts kept whole)."""
    words, out, i = name.split("_"), [], 0
    while i < len(words):
        for part in _PARTS:
            n = part.count("_") + 1
            if "_".join(words[i:i + n]) == part:
                out.append(part)
                i += n
                break
        else:
            out.append(words[i])
            i += 1
    return ".".join(out)


def is_anima(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether a kohya state dict names Anima's modules."""
    return any(ANIMA_NAME.match(key) for key in state)


def to_comfy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kohya Anima LoRA -> ComfyUI's names (same tensors, alpha kept)."""
    out = {}
    for key, value in state.items():
        name, _, weight = key.partition(".")
        prefix = next((p for p in _KOHYA_PREFIXES if name.startswith(p)), None)
        if prefix is None or weight not in _WEIGHTS:
            raise ValueError(f"unexpected key {key!r}; expected lora_unet_* / lora_te_* with {', '.join(_WEIGHTS)}")
        out[f"{_KOHYA_PREFIXES[prefix]}{dotted(name[len(prefix):])}.{_WEIGHTS[weight]}"] = value
    return out


def from_comfy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's Anima LoRA names -> kohya (lora_A/lora_B -> lora_down/lora_up, alpha kept; none: alpha = rank)."""
    out: dict[str, torch.Tensor] = {}
    back = {v: k for k, v in _WEIGHTS.items()}
    for key, value in state.items():
        prefix = next((p for p, c in _KOHYA_PREFIXES.items() if key.startswith(c)), None)
        path, weight = key[len(_KOHYA_PREFIXES.get(prefix, "")):], None
        for suffix in back:
            if path.endswith("." + suffix):
                path, weight = path[:-len(suffix) - 1], back[suffix]
        if prefix is None or weight is None:
            raise ValueError(f"unexpected key {key!r}; expected {COMFY_DIT_PREFIX}* / {COMFY_QWEN3_PREFIX}* with "
                             f"{', '.join(back)}")
        out[f"{prefix}{path.replace('.', '_')}.{weight}"] = value
    for key, value in list(out.items()):
        if key.endswith(".lora_down.weight"):
            out.setdefault(key[:-len("lora_down.weight")] + "alpha", torch.tensor(float(value.shape[0])))
    return out


def is_comfy(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether a state dict is an Anima LoRA in ComfyUI's layout."""
    return any(k.startswith((COMFY_DIT_PREFIX, COMFY_QWEN3_PREFIX)) and ".lora_A." in k for k in state)
