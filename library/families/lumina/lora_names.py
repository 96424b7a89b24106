"""Lumina Image 2.0 LoRA module names: sd-scripts' kohya names (the original NextDiT module paths, `lora_unet_
layers_0_attention_qkv`) <-> diffusers' Lumina2Transformer2DModel paths (`layers.0.attn.to_q`), for the key
conversion of tools/convert_lora.py (library/families/lora_layouts.py).

The fused `attention.qkv` stands for `attn.to_q`, `attn.to_k` and `attn.to_v`, in that row order; with
grouped-query attention k and v are narrower than q, whose rows equal the layer's input width.
"""

from __future__ import annotations

import re
from typing import Optional

from library.families.lumina.layout import BLOCK_MODULES, OUTSIDE_MODULES

# The Linears a LoRA can sit on: original path inside a block -> diffusers paths, in fused row order.
BLOCK_LINEARS: dict[str, tuple[str, ...]] = {}
for _path, (_original, _slot) in sorted(BLOCK_MODULES.items(), key=lambda kv: (kv[1][0], kv[1][1] or 0)):
    if _original in ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                     "adaLN_modulation.1"):
        BLOCK_LINEARS[_original] = (*BLOCK_LINEARS.get(_original, ()), _path)
# Outside the blocks: original path -> diffusers path (cap_embedder.0 is an RMSNorm: no LoRA).
OUTSIDE_LINEARS = {original: path for path, original in OUTSIDE_MODULES.items() if original != "cap_embedder.0"}
FUSED_QKV = "attention.qkv"
BLOCK_KINDS = ("layers", "noise_refiner", "context_refiner")
_KOHYA_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)_(\d+)_(\w+)$")
_UNDERSCORED_BLOCK = {name.replace(".", "_"): name for name in BLOCK_LINEARS}
_UNDERSCORED_OUTSIDE = {name.replace(".", "_"): name for name in OUTSIDE_LINEARS}
_DIFFUSERS_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)$")
_BLOCK_BACK = {path: original for original, paths in BLOCK_LINEARS.items() for path in paths}
_OUTSIDE_BACK = {path: original for original, path in OUTSIDE_LINEARS.items()}


def original_path(kohya_rest: str) -> Optional[str]:
    """Dotted original path of a kohya name without `lora_unet_` (`layers_0_attention_qkv` ->
    `layers.0.attention.qkv`); None when it names no Lumina LoRA layer."""
    m = _KOHYA_BLOCK.match(kohya_rest)
    if m:
        inner = _UNDERSCORED_BLOCK.get(m[3])
        return None if inner is None else f"{m[1]}.{m[2]}.{inner}"
    return _UNDERSCORED_OUTSIDE.get(kohya_rest)


def is_lumina_kohya_name(kohya_name: str) -> bool:
    """True for a `lora_unet_` name inside a joint or refiner block (no other family has these block names)."""
    return kohya_name.startswith("lora_unet_") and _KOHYA_BLOCK.match(kohya_name[len("lora_unet_"):]) is not None


def diffusers_paths(original: str) -> tuple[str, ...]:
    """The diffusers paths an original module path stands for, in fused row order."""
    m = _DIFFUSERS_BLOCK.match(original)
    if m and m[3] in BLOCK_LINEARS:
        return tuple(f"{m[1]}.{m[2]}.{p}" for p in BLOCK_LINEARS[m[3]])
    return (OUTSIDE_LINEARS[original],)


def original_of(diffusers_path: str) -> Optional[str]:
    """The original module path of a diffusers module path (`layers.0.attn.to_k` -> `layers.0.attention.qkv`);
    None when it is no Lumina LoRA layer."""
    m = _DIFFUSERS_BLOCK.match(diffusers_path)
    if m:
        inner = _BLOCK_BACK.get(m[3])
        return None if inner is None else f"{m[1]}.{m[2]}.{inner}"
    return _OUTSIDE_BACK.get(diffusers_path)


def owns_peft_paths(peft_paths) -> bool:
    """True when a PEFT file's module paths hold Lumina's blocks (`transformer.layers.N`, `.noise_refiner.N`,
    `.context_refiner.N`)."""
    return any(p.startswith(tuple(f"transformer.{kind}." for kind in BLOCK_KINDS)) for p in peft_paths)
