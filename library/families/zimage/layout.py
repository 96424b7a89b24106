"""Z-Image's original single-file layout (the Tongyi-MAI / ComfyUI names: Comfy-Org's z_image_turbo_bf16.safetensors,
ComfyUI's comfy/ldm/lumina NextDiT with z_image_modulation) and diffusers' ZImageTransformer2DModel names, both ways.

The original file fuses each block's q, k and v into `attention.qkv` (rows q, k, v; Z-Image has as many kv heads as
heads, so the three are equal), names the output `attention.out` and the q/k norms `attention.q_norm` / `k_norm`,
and has `x_embedder` / `final_layer` where diffusers has `all_x_embedder.2-1` / `all_final_layer.2-1`. Everything
else has the same name in both. ComfyUI's whole-model files put the DiT under `model.diffusion_model.`. ComfyUI's
kohya LoRA names (`lora_unet_layers_0_attention_qkv`) are these original module paths; `original_module` maps a
diffusers module to its original one and, for a fused projection, its slot.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from library.families.common.dit_layout import count_blocks, to_original_fused
from library.families.common.gguf_file import logical_shape

_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)$")
# diffusers module path inside a block -> (original path, slot in the fused qkv or None)
BLOCK_MODULES: dict[str, tuple[str, Optional[int]]] = {
    "attention.to_q": ("attention.qkv", 0), "attention.to_k": ("attention.qkv", 1),
    "attention.to_v": ("attention.qkv", 2), "attention.to_out.0": ("attention.out", None),
    "attention.norm_q": ("attention.q_norm", None), "attention.norm_k": ("attention.k_norm", None),
}
# diffusers prefixes outside the blocks -> original (the only patch size Z-Image ships: 2, frame patch 1)
OUTSIDE_PREFIXES = {"all_x_embedder.2-1": "x_embedder", "all_final_layer.2-1": "final_layer"}
_OUTSIDE_BACK = {v: k for k, v in OUTSIDE_PREFIXES.items()}


def original_module(path: str) -> tuple[str, Optional[int]]:
    """A diffusers module path -> (its original path, slot in the fused qkv or None)
    (`layers.3.attention.to_k` -> (`layers.3.attention.qkv`, 1)); other paths come back renamed only where they
    differ (`all_final_layer.2-1.linear` -> `final_layer.linear`)."""
    m = _BLOCK.match(path)
    if m:
        hit = BLOCK_MODULES.get(m[3])
        if hit is not None:
            return f"{m[1]}.{m[2]}.{hit[0]}", hit[1]
        return path, None
    for prefix, original in OUTSIDE_PREFIXES.items():
        if path == prefix or path.startswith(prefix + "."):
            return original + path[len(prefix):], None
    return path, None


def original_path(path: str) -> str:
    return original_module(path)[0]


def fused_slot(path: str) -> Optional[int]:
    return original_module(path)[1]


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ZImageTransformer2DModel state dict -> the original file's tensors (q, k, v fused)."""
    return to_original_fused(state, original_module)


def to_diffusers(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original tensors (no prefix) -> ZImageTransformer2DModel names, by diffusers' own single-file converter."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers(dict(tensors))


def infer_shape(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Depths, width, heads and caption width of an original Z-Image state dict (no prefix)."""
    # logical shapes: a GGUF-quantized tensor's own shape is its byte shape (rows, bytes per row)
    dim, patch_in = logical_shape(tensors["x_embedder.weight"])
    head_dim = logical_shape(tensors["layers.0.attention.q_norm.weight"])[0]
    return dict(layers=count_blocks(tensors, "layers"), refiner_layers=count_blocks(tensors, "noise_refiner"),
                dim=dim, heads=dim // head_dim, head_dim=head_dim,
                cap_feat_dim=logical_shape(tensors["cap_embedder.0.weight"])[0], patch_in=patch_in)
