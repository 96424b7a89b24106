"""Lumina Image 2.0's original single-file layout (NextDiT names, as Alpha-VLLM's, ComfyUI's and sd-scripts' files
hold it) and diffusers' Lumina2Transformer2DModel names, both ways.

The original file fuses each block's q, k and v into `attention.qkv` (rows q, then k, then v; grouped-query: k and v
are narrower than q) and names the parts `attention.out`, `feed_forward.w1..w3`, `attention_norm1/2`,
`ffn_norm1/2`, `adaLN_modulation.1`, `t_embedder.mlp.0/2`, `cap_embedder.0/1`, `final_layer.linear` and
`final_layer.adaLN_modulation.1`, plus an unused `norm_final.weight`. ComfyUI's whole-model files put everything
under `model.diffusion_model.`. sd-scripts' kohya LoRA names are these original module paths; `original_module`
maps a diffusers module to its original one and, for a fused projection, its slot.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from library.families.common.dit_layout import count_blocks, to_original_fused
from library.families.lumina.configs import UNUSED_NORM_KEY

_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)$")
# diffusers module path inside a block -> (original path, slot in the fused qkv or None)
BLOCK_MODULES: dict[str, tuple[str, Optional[int]]] = {
    "attn.to_q": ("attention.qkv", 0), "attn.to_k": ("attention.qkv", 1), "attn.to_v": ("attention.qkv", 2),
    "attn.to_out.0": ("attention.out", None), "attn.norm_q": ("attention.q_norm", None),
    "attn.norm_k": ("attention.k_norm", None), "feed_forward.linear_1": ("feed_forward.w1", None),
    "feed_forward.linear_2": ("feed_forward.w2", None), "feed_forward.linear_3": ("feed_forward.w3", None),
    "norm1.linear": ("adaLN_modulation.1", None), "norm1.norm": ("attention_norm1", None),
    "norm1": ("attention_norm1", None),  # the context refiner's blocks: a bare RMSNorm (no modulation)
    "norm2": ("attention_norm2", None), "ffn_norm1": ("ffn_norm1", None), "ffn_norm2": ("ffn_norm2", None),
}
OUTSIDE_MODULES = {
    "x_embedder": "x_embedder",
    "time_caption_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_caption_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_caption_embed.caption_embedder.0": "cap_embedder.0",
    "time_caption_embed.caption_embedder.1": "cap_embedder.1",
    "norm_out.linear_1": "final_layer.adaLN_modulation.1",
    "norm_out.linear_2": "final_layer.linear",
}
_OUTSIDE_BACK = {v: k for k, v in OUTSIDE_MODULES.items()}


def original_module(path: str) -> tuple[str, Optional[int]]:
    """A diffusers module path -> (its original NextDiT path, slot in the fused qkv or None)
    (`layers.3.attn.to_k` -> (`layers.3.attention.qkv`, 1)); paths it does not know come back unchanged."""
    m = _BLOCK.match(path)
    if m:
        hit = BLOCK_MODULES.get(m[3])
        if hit is not None:
            return f"{m[1]}.{m[2]}.{hit[0]}", hit[1]
        return path, None
    return OUTSIDE_MODULES.get(path, path), None


def original_path(path: str) -> str:
    return original_module(path)[0]


def fused_slot(path: str) -> Optional[int]:
    return original_module(path)[1]


def _split_param(key: str) -> tuple[str, str]:
    module, _, leaf = key.rpartition(".")
    return module, leaf


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Lumina2Transformer2DModel state dict -> the original file's tensors (q, k, v fused; `norm_final.weight`
    added as ones, as the original model holds it unused)."""
    out = to_original_fused(state, original_module)
    hidden = state["x_embedder.weight"].shape[0]
    out[UNUSED_NORM_KEY] = torch.ones(hidden, dtype=state["x_embedder.weight"].dtype)
    return out


def to_diffusers(tensors: Mapping[str, torch.Tensor], heads: int, kv_heads: int,
                 modulated_norm1: set[str]) -> dict[str, torch.Tensor]:
    """Original NextDiT tensors (no prefix) -> Lumina2Transformer2DModel names; qkv split by the head counts.
    `modulated_norm1`: the block prefixes whose norm1 is AdaLN (`layers.0`, `noise_refiner.1`, ...)."""
    out: dict[str, torch.Tensor] = {}
    back = {}
    for path, (orig, slot) in BLOCK_MODULES.items():
        if slot is None:
            back.setdefault(orig, []).append(path)
    for key, value in tensors.items():
        if key == UNUSED_NORM_KEY:
            continue
        module, leaf = _split_param(key)
        m = _BLOCK.match(module)
        if m is None:
            out[f"{_OUTSIDE_BACK.get(module, module)}.{leaf}"] = value
            continue
        block, inner = f"{m[1]}.{m[2]}", m[3]
        if inner == "attention.qkv":
            head_dim = value.shape[0] // (heads + 2 * kv_heads)
            q, k, v = torch.split(value, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)
            for name, part in (("to_q", q), ("to_k", k), ("to_v", v)):
                out[f"{block}.attn.{name}.{leaf}"] = part
            continue
        if inner == "attention_norm1":
            path = "norm1.norm" if block in modulated_norm1 else "norm1"
        else:
            paths = back.get(inner)
            path = paths[0] if paths else inner
        out[f"{block}.{path}.{leaf}"] = value
    return out


def infer_shape(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Depths, width, heads, FFN width and caption width of an original NextDiT state dict (no prefix)."""
    hidden = tensors["x_embedder.weight"].shape[0]
    head_dim = tensors["layers.0.attention.q_norm.weight"].shape[0]
    qkv = tensors["layers.0.attention.qkv.weight"].shape[0]
    heads = hidden // head_dim
    return dict(layers=count_blocks(tensors, "layers"), refiner_layers=count_blocks(tensors, "noise_refiner"),
                hidden=hidden, heads=heads,
                kv_heads=(qkv // head_dim - heads) // 2, head_dim=head_dim,
                ffn=tensors["layers.0.feed_forward.w1.weight"].shape[0],
                cap_feat_dim=tensors["cap_embedder.0.weight"].shape[0],
                patch_in=tensors["x_embedder.weight"].shape[1])
