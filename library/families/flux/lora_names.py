"""FLUX.1 LoRA module names: diffusers transformer paths -> the BFL names kohya files use.

sd-scripts trains on BFL's own model, so its names are BFL paths
(`lora_unet_double_blocks_0_img_attn_qkv`); we train on diffusers'
FluxTransformer2DModel and rename at the name level. Where BFL has one fused
Linear and diffusers several (q, k, v; single blocks also the MLP input), every
diffusers projection maps to the fused name plus its slot (row block) in it.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

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
# Rows of each projection in a fused layer, relative: linear1 holds q, k, v (hidden each) and the MLP input (4·hidden).
FUSED_WIDTHS = {"img_attn.qkv": (1, 1, 1), "txt_attn.qkv": (1, 1, 1), "linear1": (1, 1, 1, 4)}
# BFL modules outside the blocks -> diffusers paths (only LoRA files name these).
OUTSIDE_BLOCKS = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out", "final_layer.adaLN_modulation.1": "norm_out.linear",
}
# BFL's final adaLN emits (shift, scale); diffusers' norm_out expects (scale, shift).
SWAPPED_HALVES = frozenset({"norm_out.linear"})
# Kohya prefix of each diffusers part: CLIP-L is te1 and T5 te3.
KOHYA_PREFIX = {"transformer": "lora_unet", "unet": "lora_unet", "text_encoder": "lora_te1",
                "text_encoder_2": "lora_te3"}
TRANSFORMER_TARGETS = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_BFL_BLOCK = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")
_DIFFUSERS_BLOCKS = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}


def _by_bfl_name(table: dict[str, tuple[str, int]]) -> dict[str, list[str]]:
    # BFL name -> its diffusers projections in slot order; names sorted so that output order is stable.
    out: dict[str, list[str]] = {}
    for path, (name, slot) in sorted(table.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        out.setdefault(name, []).append(path)
    return out


_BFL_TABLES = {"double_blocks": _by_bfl_name(DOUBLE_BLOCK), "single_blocks": _by_bfl_name(SINGLE_BLOCK)}


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


def diffusers_paths(bfl_path: str) -> Optional[list[str]]:
    """The diffusers transformer paths a BFL LoRA layer stands for, in fused row order (`double_blocks.0.img_attn.qkv`
    -> `[transformer_blocks.0.attn.to_q, …to_k, …to_v]`); None when it is not a LoRA layer."""
    m = _BFL_BLOCK.match(bfl_path)
    if m:
        kind, index, name = m.groups()
        parts = _BFL_TABLES[kind].get(name)
        return None if parts is None else [f"{_DIFFUSERS_BLOCKS[kind]}.{index}.{p}" for p in parts]
    return [OUTSIDE_BLOCKS[bfl_path]] if bfl_path in OUTSIDE_BLOCKS else None


def bfl_path(kohya_rest: str) -> Optional[str]:
    """Dotted BFL path of a kohya module name without `lora_unet_` (`double_blocks_0_img_attn_qkv` ->
    `double_blocks.0.img_attn.qkv`); None when it names no Flux LoRA layer."""
    m = _KOHYA_BLOCK.match(kohya_rest)
    if m:
        kind = f"{m[1]}_blocks"
        name = _UNDERSCORED[kind].get(m[3])
        return None if name is None else f"{kind}.{m[2]}.{name}"
    return _UNDERSCORED["outside"].get(kohya_rest)


_KOHYA_BLOCK = re.compile(r"^(double|single)_blocks_(\d+)_(\w+)$")
_UNDERSCORED = {kind: {n.replace(".", "_"): n for n in names}
                for kind, names in (*_BFL_TABLES.items(), ("outside", OUTSIDE_BLOCKS))}


def fused_widths(bfl_path: str) -> tuple[int, ...]:
    """Relative row counts of the projections inside a BFL layer ((1,) when it is not fused)."""
    return FUSED_WIDTHS.get(bfl_path.split(".", 2)[-1] if _BFL_BLOCK.match(bfl_path) else bfl_path, (1,))


def block_layers(path: str) -> list[str]:
    """BFL paths of every LoRA layer of the block that a diffusers path lies in; [] outside the blocks."""
    m = _BLOCK.match(path)
    if not m:
        return []
    kind = "double_blocks" if m[1] == "transformer_blocks" else "single_blocks"
    return [f"{kind}.{m[2]}.{name}" for name in _BFL_TABLES[kind]]


def outside_block_name(path: str) -> Optional[str]:
    """BFL path of a diffusers module outside the blocks (`x_embedder` -> `img_in`); None when unknown."""
    return _OUTSIDE_BY_PATH.get(path)


_OUTSIDE_BY_PATH = {v: k for k, v in OUTSIDE_BLOCKS.items()}


def owns_peft_paths(paths: Iterable[str]) -> bool:
    """True when PEFT module paths (`transformer.…`) are a Flux LoRA's: only Flux has a `transformer` part."""
    return any(p.startswith("transformer.") for p in paths)
