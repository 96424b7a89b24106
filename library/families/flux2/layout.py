"""FLUX.2's original single-file layout (Black Forest Labs' flux2 names, as in ComfyUI's comfy/ldm/flux and the files
users download: flux-2-klein-4b.safetensors) and diffusers' Flux2Transformer2DModel names, both ways.

The original file fuses each double block's q, k and v into `img_attn.qkv` / `txt_attn.qkv` (rows q, k, v), calls the
q/k RMSNorm weights `...norm.query_norm.scale` / `key_norm.scale`, keeps the single blocks' fused `linear1` (q, k, v
and the MLP input, diffusers' `attn.to_qkv_mlp_proj`) and `linear2` (`attn.to_out`), and stores the final AdaLN
projection as (shift, scale) where diffusers has (scale, shift). ComfyUI's whole-model files put the DiT under
`model.diffusion_model.`. ComfyUI's kohya LoRA names (`lora_unet_double_blocks_0_img_attn_qkv`) are these original
module paths; `original_module` maps a diffusers module to its original one and, for a fused projection, its slot.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from library.families.common.dit_layout import count_blocks, swap_halves, to_original_fused

_DOUBLE = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")
_SINGLE = re.compile(r"^single_transformer_blocks\.(\d+)\.(.+)$")
# diffusers module path inside a double block -> (original path, slot in the fused qkv or None)
DOUBLE_MODULES: dict[str, tuple[str, Optional[int]]] = {
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
    "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2),
    "attn.to_out.0": ("img_attn.proj", None), "attn.to_add_out": ("txt_attn.proj", None),
    "attn.norm_q": ("img_attn.norm.query_norm", None), "attn.norm_k": ("img_attn.norm.key_norm", None),
    "attn.norm_added_q": ("txt_attn.norm.query_norm", None), "attn.norm_added_k": ("txt_attn.norm.key_norm", None),
    "ff.linear_in": ("img_mlp.0", None), "ff.linear_out": ("img_mlp.2", None),
    "ff_context.linear_in": ("txt_mlp.0", None), "ff_context.linear_out": ("txt_mlp.2", None),
}
SINGLE_MODULES: dict[str, str] = {
    "attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2",
    "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
}
OUTSIDE_MODULES: dict[str, str] = {
    "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1",
}
SWAPPED = "final_layer.adaLN_modulation.1"  # (shift, scale) in the original, (scale, shift) in diffusers


def original_module(path: str) -> tuple[str, Optional[int]]:
    """A diffusers module path -> (its original path, slot in a fused qkv or None)
    (`transformer_blocks.3.attn.to_k` -> (`double_blocks.3.img_attn.qkv`, 1)); unknown paths come back as they are."""
    m = _DOUBLE.match(path)
    if m and m[2] in DOUBLE_MODULES:
        name, slot = DOUBLE_MODULES[m[2]]
        return f"double_blocks.{m[1]}.{name}", slot
    m = _SINGLE.match(path)
    if m and m[2] in SINGLE_MODULES:
        return f"single_blocks.{m[1]}.{SINGLE_MODULES[m[2]]}", None
    return OUTSIDE_MODULES.get(path, path), None


def original_path(path: str) -> str:
    return original_module(path)[0]


def fused_slot(path: str) -> Optional[int]:
    return original_module(path)[1]


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Flux2Transformer2DModel state dict -> the original file's tensors (q, k, v fused, norms as `.scale`)."""
    def adjust(name: str, leaf: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name.endswith("_norm") and leaf == "weight":
            leaf = "scale"
        return leaf, swap_halves(value) if name == SWAPPED else value

    return to_original_fused(state, original_module, adjust=adjust)


def to_diffusers(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original tensors (no prefix) -> Flux2Transformer2DModel names, by diffusers' own single-file converter."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers(dict(tensors))


def infer_shape(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Depths, heads, head width, text width and guidance of an original FLUX.2 state dict (no prefix)."""
    inner, patch_in = tensors["img_in.weight"].shape
    head_dim = tensors["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
    return dict(double_layers=count_blocks(tensors, "double_blocks"),
                single_layers=count_blocks(tensors, "single_blocks"), heads=inner // head_dim,
                head_dim=head_dim, joint_attention_dim=tensors["txt_in.weight"].shape[1], patch_in=patch_in,
                mlp_hidden=tensors["double_blocks.0.img_mlp.2.weight"].shape[1],
                guidance_embeds="guidance_in.in_layer.weight" in tensors)
