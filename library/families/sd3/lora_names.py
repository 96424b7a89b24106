"""SD3 / SD3.5 module names: diffusers' SD3Transformer2DModel paths <-> the SAI (MMDiT) names that single files
and kohya LoRA files use.

sd-scripts trains on SAI's own MMDiT, so its LoRA names are SAI paths
(`lora_unet_joint_blocks_0_x_block_attn_qkv`); we train on diffusers' transformer and rename
at the name level. Where SAI has one fused `qkv` Linear and diffusers three (q, k, v), each
diffusers projection maps to the fused name plus its slot (row block) in it, as for FLUX.1.
"""

from __future__ import annotations

import re
from typing import Optional

# diffusers path inside a JointTransformerBlock -> (SAI path inside joint_blocks.N, slot in the fused layer)
BLOCK: dict[str, tuple[str, int]] = {
    "norm1.linear": ("x_block.adaLN_modulation.1", 0),
    "norm1_context.linear": ("context_block.adaLN_modulation.1", 0),
    "attn.to_q": ("x_block.attn.qkv", 0), "attn.to_k": ("x_block.attn.qkv", 1), "attn.to_v": ("x_block.attn.qkv", 2),
    "attn.add_q_proj": ("context_block.attn.qkv", 0), "attn.add_k_proj": ("context_block.attn.qkv", 1),
    "attn.add_v_proj": ("context_block.attn.qkv", 2),
    "attn.to_out.0": ("x_block.attn.proj", 0), "attn.to_add_out": ("context_block.attn.proj", 0),
    "attn2.to_q": ("x_block.attn2.qkv", 0), "attn2.to_k": ("x_block.attn2.qkv", 1),
    "attn2.to_v": ("x_block.attn2.qkv", 2), "attn2.to_out.0": ("x_block.attn2.proj", 0),
    "ff.net.0.proj": ("x_block.mlp.fc1", 0), "ff.net.2": ("x_block.mlp.fc2", 0),
    "ff_context.net.0.proj": ("context_block.mlp.fc1", 0), "ff_context.net.2": ("context_block.mlp.fc2", 0),
}
FUSED = frozenset({"x_block.attn.qkv", "context_block.attn.qkv", "x_block.attn2.qkv"})
# q/k RMSNorm scales (SD3.5): diffusers path in a block -> SAI path.
BLOCK_NORMS = {"attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
               "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
               "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
# Modules outside the blocks: SAI path -> diffusers path (LoRA files name these with sd-scripts' emb_dims).
OUTSIDE_BLOCKS = {
    "x_embedder.proj": "pos_embed.proj", "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
    "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
    "context_embedder": "context_embedder", "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
}
# Kohya prefix of each diffusers part: CLIP-L te1, CLIP-G te2, T5 te3 (sd-scripts' lora_sd3.py).
KOHYA_PREFIX = {"transformer": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2",
                "text_encoder_3": "lora_te3"}
TRANSFORMER_TARGETS = ("JointTransformerBlock",)
_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")
_SAI_BLOCK = re.compile(r"^joint_blocks\.(\d+)\.(.+)$")
BY_SAI: dict[str, list[str]] = {}
for _path, (_sai, _slot) in sorted(BLOCK.items(), key=lambda kv: kv[1]):
    BY_SAI.setdefault(_sai, []).append(_path)
_OUTSIDE_BY_PATH = {v: k for k, v in OUTSIDE_BLOCKS.items()}


def lookup(path: str) -> Optional[tuple[str, int]]:
    m = _BLOCK.match(path)
    if not m:
        return None
    hit = BLOCK.get(m[2])
    return None if hit is None else (f"joint_blocks.{m[1]}.{hit[0]}", hit[1])


def sai_module_path(path: str) -> str:
    """A diffusers transformer module path as its SAI path (`transformer_blocks.0.attn.to_k` ->
    `joint_blocks.0.x_block.attn.qkv`); paths outside the blocks' layers come back unchanged."""
    hit = lookup(path)
    if hit is not None:
        return hit[0]
    return _OUTSIDE_BY_PATH.get(path, path)


def fused_slot(path: str) -> Optional[int]:
    """Slot of a diffusers projection inside its fused SAI qkv (q 0, k 1, v 2); None when not fused."""
    hit = lookup(path)
    if hit is None:
        return None
    return hit[1] if hit[0].split(".", 2)[2] in FUSED else None


def diffusers_paths(sai_path: str) -> Optional[list[str]]:
    """The diffusers paths a SAI module stands for, in fused row order; None when it names no LoRA layer."""
    m = _SAI_BLOCK.match(sai_path)
    if m:
        paths = BY_SAI.get(m[2])
        return None if paths is None else [f"transformer_blocks.{m[1]}.{p}" for p in paths]
    return [OUTSIDE_BLOCKS[sai_path]] if sai_path in OUTSIDE_BLOCKS else None


_UNDERSCORED = {name.replace(".", "_"): name for name in (*BY_SAI, *OUTSIDE_BLOCKS)}
_KOHYA_BLOCK = re.compile(r"^joint_blocks_(\d+)_(\w+)$")


def sai_path(kohya_rest: str) -> Optional[str]:
    """Dotted SAI path of a kohya module name without `lora_unet_` (`joint_blocks_0_x_block_attn_qkv` ->
    `joint_blocks.0.x_block.attn.qkv`); None when it names no SD3 LoRA layer."""
    m = _KOHYA_BLOCK.match(kohya_rest)
    if m:
        name = _UNDERSCORED.get(m[2])
        return None if name is None or name not in BY_SAI else f"joint_blocks.{m[1]}.{name}"
    name = _UNDERSCORED.get(kohya_rest)
    return name if name in OUTSIDE_BLOCKS else None


def is_sd3_kohya_name(kohya_name: str) -> bool:
    """True for a `lora_unet_joint_blocks_...` name (only SD3 has joint blocks)."""
    return kohya_name.startswith("lora_unet_joint_blocks_")
