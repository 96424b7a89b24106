"""FLUX.1 LoRA module names: diffusers transformer paths -> the BFL names kohya files use.

sd-scripts trains on BFL's own model, so its names are BFL paths
(`lora_unet_double_blocks_0_img_attn_qkv`); we train on diffusers'
FluxTransformer2DModel and rename at the name level. Where BFL has one fused
Linear and diffusers several (q, k, v; single blocks also the MLP input), every
diffusers projection maps to the fused name plus its slot (row block) in it.
"""

from __future__ import annotations

import re
from typing import Optional

# diffusers path inside a double block -> (BFL name inside the block, slot in the fused layer)
DOUBLE_BLOCK: dict[str, tuple[str, int]] = {
    "norm1.linear": ("img_mod.lin", 0), "norm1_context.linear": ("txt_mod.lin", 0),
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
    "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2),
    "attn.to_out.0": ("img_attn.proj", 0), "attn.to_add_out": ("txt_attn.proj", 0),
    "ff.net.0.proj": ("img_mlp.0", 0), "ff.net.2": ("img_mlp.2", 0),
    "ff_context.net.0.proj": ("txt_mlp.0", 0), "ff_context.net.2": ("txt_mlp.2", 0),
}
SINGLE_BLOCK: dict[str, tuple[str, int]] = {
    "attn.to_q": ("linear1", 0), "attn.to_k": ("linear1", 1), "attn.to_v": ("linear1", 2),
    "proj_mlp": ("linear1", 3), "proj_out": ("linear2", 0), "norm.linear": ("modulation.lin", 0),
}
# Fused BFL layers: how many diffusers projections each holds.
FUSED_PARTS = {"img_attn.qkv": 3, "txt_attn.qkv": 3, "linear1": 4}
TRANSFORMER_TARGETS = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
T5_TARGETS = ("T5Attention", "T5DenseGatedActDense")
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def _lookup(path: str) -> Optional[tuple[str, int]]:
    m = _BLOCK.match(path)
    if not m:
        return None
    kind, index, rest = m.groups()
    table, bfl = (DOUBLE_BLOCK, "double_blocks") if kind == "transformer_blocks" else (SINGLE_BLOCK, "single_blocks")
    hit = table.get(rest)
    return None if hit is None else (f"{bfl}.{index}.{hit[0]}", hit[1])


def bfl_module_path(path: str) -> str:
    """A diffusers transformer module path as its BFL path (`transformer_blocks.0.attn.to_k` -> `double_blocks.0.img_attn.qkv`).

    Paths outside the blocks' LoRA layers come back unchanged.
    """
    hit = _lookup(path)
    return path if hit is None else hit[0]


def fused_slot(path: str) -> Optional[int]:
    """Slot of a diffusers projection inside its fused BFL layer (q 0, k 1, v 2, MLP-in 3); None when not fused."""
    hit = _lookup(path)
    if hit is None:
        return None
    name = hit[0].split(".", 2)[2]
    return hit[1] if name in FUSED_PARTS else None

