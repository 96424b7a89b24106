"""FLUX.1 on-disk layouts: BFL's single-file transformer <-> diffusers' FluxTransformer2DModel, and the
key layouts of the separate CLIP-L / T5-XXL files that go with it.

The transformer conversion is exact in both directions. BFL fuses q, k, v into one
`qkv` Linear per attention and q, k, v plus the MLP input into `linear1` per single
block; diffusers keeps them apart. The module names and the fused row slots come
from flux_lora_names (the same tables name LoRA modules); this module adds the
parameters LoRA never touches (the RMSNorm `scale`s) and the row arithmetic.
BFL's final adaLN Linear emits (shift, scale), diffusers' norm_out (scale, shift),
so those two halves swap. Keys may carry the `model.diffusion_model.` prefix of
all-in-one files; float8 tensors (also ComfyUI's `scale_weight`-scaled ones) are
upcast, since nothing here trains in float8.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Optional

import torch

from library.core.safetensors_io import Deferred, concat
from library.families.flux.lora_names import (
    SWAPPED_HALVES,
    bfl_module_path,
    diffusers_paths,
    fused_slot,
    fused_widths,
    outside_block_name,
)
from library.families.common.gguf_file import logical_shape
from library.families.common.loading import upcast_float8

BFL_PREFIX = "model.diffusion_model."
# RMSNorm scales of q and k (not LoRA layers, so not in flux_lora_names): diffusers path in a block -> BFL path.
DOUBLE_BLOCK_NORMS = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                      "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
SINGLE_BLOCK_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
_NORMS = {"transformer_blocks": ("double_blocks", DOUBLE_BLOCK_NORMS),
          "single_transformer_blocks": ("single_blocks", SINGLE_BLOCK_NORMS)}
_NORMS_BY_BFL = {bfl: (diffusers, {v: k for k, v in table.items()}) for diffusers, (bfl, table) in _NORMS.items()}
_BLOCK = re.compile(r"^(\w+)\.(\d+)\.(.+)$")
MLP_RATIO = 4  # diffusers' FluxSingleTransformerBlock fixes it; linear1 holds 3 + 4 widths


class BflLayoutError(ValueError):
    """A tensor name or shape that does not fit the BFL FLUX.1 transformer layout (message: one line)."""


# --- reading: prefix, float8 ----------------------------------------------------------------

def transformer_tensors(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The transformer's tensors without the `model.diffusion_model.` prefix.

    All-in-one files hold the text encoders and the AE beside the prefixed transformer;
    only the prefixed keys are kept then.
    """
    if any(k.startswith(BFL_PREFIX) for k in checkpoint):
        return {k[len(BFL_PREFIX):]: v for k, v in checkpoint.items() if k.startswith(BFL_PREFIX)}
    return dict(checkpoint)


# --- diffusers -> BFL --------------------------------------------------------------------------

def diffusers_key_to_bfl(key: str) -> tuple[str, Optional[int]]:
    """(BFL key, row slot in its fused tensor or None) of one FluxTransformer2DModel key.

    `transformer_blocks.0.attn.to_k.weight` -> (`double_blocks.0.img_attn.qkv.weight`, 1).
    """
    module, param = key.rsplit(".", 1)
    renamed = bfl_module_path(module)
    if renamed != module:
        return f"{renamed}.{param}", fused_slot(module)
    outside = outside_block_name(module)
    if outside is not None:
        return f"{outside}.{param}", None
    m = _BLOCK.match(module)
    if m and m[1] in _NORMS and param == "weight":
        bfl_kind, table = _NORMS[m[1]]
        if m[3] in table:
            return f"{bfl_kind}.{m[2]}.{table[m[3]]}.scale", None
    raise BflLayoutError(f"no BFL name for FluxTransformer2DModel key {key}")


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def diffusers_to_bfl(state_dict: Mapping[str, torch.Tensor], lazy: bool = False) -> dict[str, Any]:
    """A FluxTransformer2DModel state dict in the BFL layout (as in flux1-dev.safetensors, no prefix).

    With `lazy`, the fused and half-swapped tensors are Deferred (made when written), so the result
    holds only the model's own tensors.
    """
    out: dict[str, Any] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        bfl_key, slot = diffusers_key_to_bfl(key)
        if slot is not None:
            fused.setdefault(bfl_key, {})[slot] = tensor
            continue
        if key.rsplit(".", 1)[0] not in SWAPPED_HALVES:
            out[bfl_key] = tensor
        else:
            out[bfl_key] = Deferred(lambda t=tensor: _swap_halves(t), tensor.shape, tensor.dtype) if lazy \
                else _swap_halves(tensor)
    for bfl_key, slots in fused.items():
        expected = len(fused_widths(bfl_key.rsplit(".", 1)[0]))
        if sorted(slots) != list(range(expected)):
            raise BflLayoutError(f"{bfl_key}: expected {expected} projections to fuse, found slots {sorted(slots)}")
        ordered = [slots[i] for i in range(expected)]
        out[bfl_key] = concat(ordered) if lazy else torch.cat(ordered, dim=0)
    return out


# --- BFL -> diffusers --------------------------------------------------------------------------

def _norm_to_diffusers(module: str) -> Optional[str]:
    m = _BLOCK.match(module)
    if not m or m[1] not in _NORMS_BY_BFL:
        return None
    diffusers_kind, table = _NORMS_BY_BFL[m[1]]
    return f"{diffusers_kind}.{m[2]}.{table[m[3]]}" if m[3] in table else None


def bfl_to_diffusers(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL transformer state dict (prefix optional) as FluxTransformer2DModel's; BflLayoutError on a stray key.

    Fused tensors are split into views by row; float8 tensors are upcast to bfloat16.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in upcast_float8(transformer_tensors(checkpoint)).items():
        module, param = key.rsplit(".", 1) if "." in key else (key, "")
        if param == "scale":
            target = _norm_to_diffusers(module)
            if target is None:
                raise BflLayoutError(f"unexpected tensor {key} in a BFL FLUX.1 transformer")
            out[f"{target}.weight"] = tensor
            continue
        paths = diffusers_paths(module)
        if paths is None or param not in ("weight", "bias"):
            raise BflLayoutError(f"unexpected tensor {key} in a BFL FLUX.1 transformer")
        if len(paths) == 1:
            out[f"{paths[0]}.{param}"] = _swap_halves(tensor) if paths[0] in SWAPPED_HALVES else tensor
            continue
        widths = fused_widths(module)
        unit, rest = divmod(tensor.shape[0], sum(widths))
        if rest:
            raise BflLayoutError(f"{key}: {tensor.shape[0]} rows do not split into parts of relative widths {widths}")
        for path, part in zip(paths, tensor.split([unit * w for w in widths], dim=0)):
            out[f"{path}.{param}"] = part
    return out


# --- configuration from shapes -----------------------------------------------------------------

def block_count(keys: Iterable[str], kind: str) -> int:
    return len({m[1] for k in keys if (m := re.match(kind + r"\.(\d+)\.", k))})


def infer_transformer_config(checkpoint: Mapping[str, torch.Tensor]) -> dict:
    """FluxTransformer2DModel kwargs read from BFL tensor names and shapes (dev: guidance_in present).

    The rotary axes are not stored in the weights; they come from the built-in preset
    of the same head size (FLUX.1's (16, 56, 56) for 128).
    """
    from library.families.flux.configs import PRESETS

    ckpt = transformer_tensors(checkpoint)
    try:
        # the logical shapes: a GGUF-quantized tensor's own shape is its byte shape (rows, bytes per row)
        inner, in_channels = logical_shape(ckpt["img_in.weight"])
        head_dim = logical_shape(ckpt["double_blocks.0.img_attn.norm.query_norm.scale"])[0]
        joint_dim = logical_shape(ckpt["txt_in.weight"])[1]
        pooled_dim = logical_shape(ckpt["vector_in.in_layer.weight"])[1]
        out_channels = logical_shape(ckpt["final_layer.linear.weight"])[0]
    except KeyError as e:
        raise BflLayoutError(f"missing tensor {e.args[0]} of a BFL FLUX.1 transformer") from None
    linear1 = ckpt.get("single_blocks.0.linear1.weight")
    if linear1 is not None and logical_shape(linear1)[0] != (3 + MLP_RATIO) * inner:
        raise BflLayoutError(f"single_blocks.0.linear1.weight: expected {(3 + MLP_RATIO) * inner} rows "
                             f"(q, k, v and a {MLP_RATIO}x MLP), found {logical_shape(linear1)[0]}")
    axes = next((p.axes_dims_rope for p in PRESETS.values() if p.head_dim == head_dim), None)
    if axes is None or inner % head_dim:
        raise BflLayoutError(f"unsupported attention head size {head_dim} (hidden size {inner})")
    config = dict(patch_size=1, in_channels=in_channels, num_layers=block_count(ckpt, "double_blocks"),
                  num_single_layers=block_count(ckpt, "single_blocks"), attention_head_dim=head_dim,
                  num_attention_heads=inner // head_dim, joint_attention_dim=joint_dim,
                  pooled_projection_dim=pooled_dim, guidance_embeds="guidance_in.in_layer.weight" in ckpt,
                  axes_dims_rope=tuple(axes))
    if out_channels != in_channels:
        config["out_channels"] = out_channels
    return config


# --- the separate text-encoder files -----------------------------------------------------------

CLIP_FILE_PREFIX = "text_model."  # ComfyUI's / HF's clip_l.safetensors; transformers 5 has no such level
_CLIP_IGNORED = ("text_projection.weight", "logit_scale")


def clip_l_to_file(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIPTextModel tensors with the `text_model.` keys of a clip_l.safetensors file."""
    return {(k if k.startswith(CLIP_FILE_PREFIX) else CLIP_FILE_PREFIX + k): v for k, v in state_dict.items()
            if not k.endswith("position_ids")}


def clip_l_from_file(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A clip_l.safetensors state dict (with or without `text_model.`) as transformers 5 CLIPTextModel keys."""
    out = {}
    for key, tensor in checkpoint.items():
        bare = key[len(CLIP_FILE_PREFIX):] if key.startswith(CLIP_FILE_PREFIX) else key
        if bare.endswith("position_ids") or bare in _CLIP_IGNORED:
            continue
        out[bare] = tensor
    return out


