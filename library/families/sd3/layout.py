"""SD3 / SD3.5 on-disk layouts: SAI's single file (sd3_medium.safetensors, sd3.5_large.safetensors) <->
diffusers' SD3Transformer2DModel, the text encoders and VAE inside such a file, and the one weight whose
row order the two layouts disagree on.

A SAI file holds the MMDiT under `model.diffusion_model.` (fused `qkv` per attention, SAI names),
the VAE under `first_stage_model.` (LDM layout) and, in the all-in-one files, CLIP-L / CLIP-G / T5
under `text_encoders.{clip_l,clip_g,t5xxl}.transformer.`. The conversion is exact both ways.
The final adaLN Linear (`final_layer.adaLN_modulation.1`) and the last block's context adaLN
(`joint_blocks.<last>.context_block.adaLN_modulation.1`, the "pre only" block) emit (shift, scale);
diffusers' AdaLayerNormContinuous reads (scale, shift), so those halves swap.

The last block's context adaLN is also a LoRA layer sd-scripts trains, named in SAI row order. So
that a LoRA on it is in that order too, the loaded transformer keeps this one Linear in SAI order
(`to_sai_order`): its rows are swapped and its norm reads (shift, scale). Saving a diffusers folder
swaps it back for the time of the write (`diffusers_order`).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Mapping, Optional

import torch
from diffusers.models.normalization import AdaLayerNormContinuous
from torch import nn

from library.core.safetensors_io import Deferred, concat
from library.families.sd3.lora_names import (
    BY_SAI,
    BLOCK_NORMS,
    OUTSIDE_BLOCKS,
    lookup,
    fused_slot,
)

SAI_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TEXT_ENCODER_PREFIXES = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
                         "t5xxl": "text_encoders.t5xxl.transformer."}
_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")
_SAI_BLOCK = re.compile(r"^joint_blocks\.(\d+)\.(.+)$")
_NORMS_BY_SAI = {v: k for k, v in BLOCK_NORMS.items()}
_OUTSIDE_BY_PATH = {v: k for k, v in OUTSIDE_BLOCKS.items()}
FINAL_ADALN = "norm_out.linear"


class SaiLayoutError(ValueError):
    """A tensor name or shape that does not fit the SAI SD3 layout (message: one line)."""


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def pre_only_block(keys) -> Optional[int]:
    """Index of the block whose context stream is "pre only" (no `attn.to_add_out`) in diffusers keys."""
    blocks = {int(m[1]) for k in keys if (m := _BLOCK.match(k))}
    with_out = {int(m[1]) for k in keys if (m := _BLOCK.match(k)) and m[2].startswith("attn.to_add_out.")}
    rest = sorted(blocks - with_out)
    return rest[0] if rest else None


def _swapped_path(module: str, last: Optional[int]) -> bool:
    return module == FINAL_ADALN or (last is not None and module == f"transformer_blocks.{last}.norm1_context.linear")


# --- diffusers -> SAI ----------------------------------------------------------------------------

def diffusers_key_to_sai(key: str) -> tuple[str, Optional[int]]:
    """(SAI key, row slot in its fused tensor or None) of one SD3Transformer2DModel key."""
    if key == "pos_embed.pos_embed":
        return "pos_embed", None
    module, param = key.rsplit(".", 1)
    hit = lookup(module)
    if hit is not None:
        return f"{hit[0]}.{param}", fused_slot(module)
    m = _BLOCK.match(module)
    if m and m[2] in BLOCK_NORMS:
        return f"joint_blocks.{m[1]}.{BLOCK_NORMS[m[2]]}.{param}", None
    if module in _OUTSIDE_BY_PATH:
        return f"{_OUTSIDE_BY_PATH[module]}.{param}", None
    raise SaiLayoutError(f"no SAI name for SD3Transformer2DModel key {key}")


def diffusers_to_sai(state_dict: Mapping[str, torch.Tensor], lazy: bool = False) -> dict[str, Any]:
    """A diffusers-order SD3Transformer2DModel state dict in the SAI layout (no prefix).

    With `lazy`, fused and half-swapped tensors are Deferred (made when written).
    """
    last = pre_only_block(state_dict.keys())
    out: dict[str, Any] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        sai_key, slot = diffusers_key_to_sai(key)
        if slot is not None:
            fused.setdefault(sai_key, {})[slot] = tensor
        elif _swapped_path(key.rsplit(".", 1)[0], last):
            out[sai_key] = Deferred(lambda t=tensor: swap_halves(t), tensor.shape, tensor.dtype) if lazy \
                else swap_halves(tensor)
        else:
            out[sai_key] = tensor
    for sai_key, slots in fused.items():
        if sorted(slots) != [0, 1, 2]:
            raise SaiLayoutError(f"{sai_key}: expected q, k and v to fuse, found slots {sorted(slots)}")
        ordered = [slots[i] for i in range(3)]
        out[sai_key] = concat(ordered) if lazy else torch.cat(ordered, dim=0)
    return out


# --- SAI -> diffusers ----------------------------------------------------------------------------

def transformer_tensors(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MMDiT's tensors without the `model.diffusion_model.` prefix (a bare transformer file as it is)."""
    if any(k.startswith(SAI_PREFIX) for k in checkpoint):
        return {k[len(SAI_PREFIX):]: v for k, v in checkpoint.items() if k.startswith(SAI_PREFIX)}
    return {k: v for k, v in checkpoint.items() if not k.startswith((VAE_PREFIX, "text_encoders."))}


def sai_to_diffusers(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A SAI MMDiT state dict (prefix optional) as SD3Transformer2DModel's (diffusers order); SaiLayoutError
    on a stray key. Fused tensors are split into views by row."""
    tensors = transformer_tensors(checkpoint)
    blocks = {int(m[1]) for k in tensors if (m := _SAI_BLOCK.match(k))}
    with_proj = {int(m[1]) for k in tensors if (m := _SAI_BLOCK.match(k)) and m[2].startswith("context_block.attn.proj.")}
    pre_only = sorted(blocks - with_proj)
    last = pre_only[0] if pre_only else None
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key == "pos_embed":
            out["pos_embed.pos_embed"] = tensor
            continue
        module, param = key.rsplit(".", 1) if "." in key else (key, "")
        m = _SAI_BLOCK.match(module)
        if m and m[2] in _NORMS_BY_SAI:
            out[f"transformer_blocks.{m[1]}.{_NORMS_BY_SAI[m[2]]}.{param}"] = tensor
            continue
        if m:
            paths = [f"transformer_blocks.{m[1]}.{p}" for p in BY_SAI.get(m[2], [])]
        else:
            paths = [OUTSIDE_BLOCKS[module]] if module in OUTSIDE_BLOCKS else []
        if not paths or param not in ("weight", "bias"):
            raise SaiLayoutError(f"unexpected tensor {key} in an SD3 MMDiT")
        if len(paths) == 1:
            out[f"{paths[0]}.{param}"] = swap_halves(tensor) if _swapped_path(paths[0], last) else tensor
            continue
        if tensor.shape[0] % 3:
            raise SaiLayoutError(f"{key}: {tensor.shape[0]} rows do not split into q, k and v")
        for path, part in zip(paths, tensor.chunk(3, dim=0)):
            out[f"{path}.{param}"] = part
    return out


def infer_transformer_config(checkpoint: Mapping[str, torch.Tensor]) -> dict:
    """SD3Transformer2DModel kwargs from a SAI MMDiT's tensor shapes (as sd-scripts' analyze_state_dict_state)."""
    from library.families.sd3.configs import HEAD_DIM

    ckpt = transformer_tensors(checkpoint)
    try:
        proj = ckpt["x_embedder.proj.weight"]
        pos = ckpt["pos_embed"]
        y = ckpt["y_embedder.mlp.0.weight"]
        context = ckpt["context_embedder.weight"]
        final = ckpt["final_layer.linear.weight"]
    except KeyError as e:
        raise SaiLayoutError(f"not an SD3 MMDiT: no tensor for {e.args[0]}") from None
    hidden, in_channels, patch = proj.shape[0], proj.shape[1], proj.shape[2]
    if hidden % HEAD_DIM:
        raise SaiLayoutError(f"hidden size {hidden} is not a multiple of {HEAD_DIM} (SD3's head size)")
    layers = {int(m[1]) for k in ckpt if (m := _SAI_BLOCK.match(k))}
    if not layers:
        raise SaiLayoutError("not an SD3 MMDiT: no joint_blocks")
    dual = sorted({int(m[1]) for k in ckpt if (m := _SAI_BLOCK.match(k)) and m[2].startswith("x_block.attn2.")})
    side = round(pos.shape[1] ** 0.5)
    return dict(sample_size=128, patch_size=patch, in_channels=in_channels, num_layers=max(layers) + 1,
                attention_head_dim=HEAD_DIM, num_attention_heads=hidden // HEAD_DIM,
                joint_attention_dim=context.shape[1], caption_projection_dim=hidden,
                pooled_projection_dim=y.shape[1], out_channels=final.shape[0] // (patch * patch),
                pos_embed_max_size=side, dual_attention_layers=tuple(dual),
                qk_norm="rms_norm" if "joint_blocks.0.x_block.attn.ln_q.weight" in ckpt else None)


# --- the one Linear kept in SAI row order ------------------------------------------------------------

class SaiOrderAdaLayerNorm(AdaLayerNormContinuous):
    """AdaLayerNormContinuous whose Linear emits (shift, scale), as SAI's pre-only context adaLN."""

    def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        shift, scale = torch.chunk(emb, 2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


def _pre_only_norm(transformer: nn.Module) -> Optional[nn.Module]:
    for block in transformer.transformer_blocks:
        if getattr(block, "context_pre_only", False):
            return block.norm1_context
    return None


def in_sai_order(transformer: nn.Module) -> bool:
    norm = _pre_only_norm(transformer)
    return isinstance(norm, SaiOrderAdaLayerNorm)


@torch.no_grad()
def to_sai_order(transformer: nn.Module) -> nn.Module:
    """Keep the pre-only block's context adaLN Linear in SAI row order (see the module docstring); idempotent."""
    norm = _pre_only_norm(transformer)
    if norm is None or in_sai_order(transformer):
        return transformer
    for p in norm.linear.parameters():
        p.data = swap_halves(p.data)
    norm.__class__ = SaiOrderAdaLayerNorm
    return transformer


@torch.no_grad()
def _to_diffusers_order(transformer: nn.Module) -> None:
    norm = _pre_only_norm(transformer)
    for p in norm.linear.parameters():
        p.data = swap_halves(p.data)
    norm.__class__ = AdaLayerNormContinuous


@contextlib.contextmanager
def diffusers_order(transformer: nn.Module) -> Iterator[nn.Module]:
    """The transformer exactly as diffusers has it for the time of the block (saving a folder, diffusers' own calls)."""
    if not in_sai_order(transformer):
        yield transformer
        return
    _to_diffusers_order(transformer)
    try:
        yield transformer
    finally:
        to_sai_order(transformer)


def diffusers_state_dict(transformer: nn.Module) -> dict[str, Any]:
    """The transformer's state dict in diffusers' order (the SAI-order Linear's tensors swapped back, lazily)."""
    state = transformer.state_dict()
    if not in_sai_order(transformer):
        return state
    last = pre_only_block(state.keys())
    for param in ("weight", "bias"):
        key = f"transformer_blocks.{last}.norm1_context.linear.{param}"
        if key in state:
            state[key] = swap_halves(state[key])
    return state


# --- the text encoders and VAE inside an all-in-one file ---------------------------------------------

def text_encoder_tensors(checkpoint: Mapping[str, torch.Tensor], which: str) -> dict[str, torch.Tensor]:
    """The tensors of CLIP-L / CLIP-G / T5 ("clip_l", "clip_g", "t5xxl") inside a SAI file, prefix removed."""
    prefix = TEXT_ENCODER_PREFIXES[which]
    return {k[len(prefix):]: v for k, v in checkpoint.items() if k.startswith(prefix)}
