"""State-dict conversion between diffusers/transformers models and the original LDM single-file layout.

One name mapping per part (diffusers key -> LDM key) serves both directions:
saving walks a model's keys forward; loading builds the target model first (on
the meta device) and pulls each of its keys from the checkpoint through the
same mapping. Shapes alone decide the rest (conv 1x1 vs linear VAE attention).

LDM prefixes: UNet `model.diffusion_model.`, VAE `first_stage_model.`, SD1
CLIP-L `cond_stage_model.transformer.` (HF names), SD2 OpenCLIP-H
`cond_stage_model.model.` (OpenCLIP names, fused attention in_proj).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

import torch

from library.core.safetensors_io import Deferred, concat, materialized

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "cond_stage_model.transformer."
OPEN_CLIP_PREFIX = "cond_stage_model.model."

_RESNET_UNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
                    "self_attn.out_proj": "attn.out_proj"}


class LayoutError(KeyError):
    """A key the target model needs is missing from the checkpoint (message: the LDM key)."""


def _rename_head(rest: str, table: Mapping[str, str]) -> str:
    """Replace the leading module name of `rest` using `table` (longest match first)."""
    for old in sorted(table, key=len, reverse=True):
        if rest.startswith(old + "."):
            return table[old] + rest[len(old):]
    return rest


# --- UNet ---------------------------------------------------------------------

def unet_key_to_ldm(key: str, layers_per_block: int, up_blocks_with_attention: set[int]) -> str:
    """Map one diffusers UNet2DConditionModel key to its LDM name (without the prefix)."""
    per = layers_per_block + 1  # LDM input/output blocks per diffusers block
    fixed = {"conv_in.": "input_blocks.0.0.", "time_embedding.linear_1.": "time_embed.0.",
             "time_embedding.linear_2.": "time_embed.2.", "conv_norm_out.": "out.0.", "conv_out.": "out.2."}
    for old, new in fixed.items():
        if key.startswith(old):
            return new + key[len(old):]
    if m := re.match(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        i, j, rest = int(m[1]), int(m[2]), m[3]
        return f"input_blocks.{per * i + j + 1}.0.{_rename_head(rest, _RESNET_UNET)}"
    if m := re.match(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", key):
        return f"input_blocks.{per * int(m[1]) + int(m[2]) + 1}.1.{m[3]}"
    if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
        return f"input_blocks.{per * (int(m[1]) + 1)}.0.op.{m[2]}"
    if m := re.match(r"mid_block\.resnets\.(\d+)\.(.+)", key):
        return f"middle_block.{2 * int(m[1])}.{_rename_head(m[2], _RESNET_UNET)}"
    if m := re.match(r"mid_block\.attentions\.0\.(.+)", key):
        return f"middle_block.1.{m[1]}"
    if m := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        i, j, rest = int(m[1]), int(m[2]), m[3]
        return f"output_blocks.{per * i + j}.0.{_rename_head(rest, _RESNET_UNET)}"
    if m := re.match(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", key):
        return f"output_blocks.{per * int(m[1]) + int(m[2])}.1.{m[3]}"
    if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
        i = int(m[1])
        slot = 2 if i in up_blocks_with_attention else 1
        return f"output_blocks.{per * i + layers_per_block}.{slot}.conv.{m[2]}"
    raise LayoutError(f"no LDM name for UNet key {key}")


def unet_key_map(diffusers_keys: Iterable[str], layers_per_block: int) -> dict[str, str]:
    """{diffusers key: full LDM key} for every key of a diffusers UNet state dict."""
    keys = list(diffusers_keys)
    with_attention = {int(m[1]) for k in keys if (m := re.match(r"up_blocks\.(\d+)\.attentions\.", k))}
    return {k: UNET_PREFIX + unet_key_to_ldm(k, layers_per_block, with_attention) for k in keys}


# --- VAE ----------------------------------------------------------------------

def vae_key_to_ldm(key: str, num_blocks: int) -> str:
    """Map one diffusers AutoencoderKL key to its LDM name (without the prefix)."""
    for side in ("encoder", "decoder"):
        if key.startswith(f"{side}.conv_norm_out."):
            return f"{side}.norm_out." + key[len(f"{side}.conv_norm_out."):]
        if m := re.match(side + r"\.mid_block\.resnets\.(\d+)\.(.+)", key):
            return f"{side}.mid.block_{int(m[1]) + 1}.{_rename_head(m[2], {'conv_shortcut': 'nin_shortcut'})}"
        if m := re.match(side + r"\.mid_block\.attentions\.0\.(.+)", key):
            return f"{side}.mid.attn_1.{_rename_head(m[1], _VAE_ATTENTION)}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        return f"encoder.down.{m[1]}.block.{m[2]}.{_rename_head(m[3], {'conv_shortcut': 'nin_shortcut'})}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
        return f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
    # The decoder's up blocks run in the opposite order in LDM numbering.
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        block = num_blocks - 1 - int(m[1])
        return f"decoder.up.{block}.block.{m[2]}.{_rename_head(m[3], {'conv_shortcut': 'nin_shortcut'})}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
        return f"decoder.up.{num_blocks - 1 - int(m[1])}.upsample.conv.{m[2]}"
    return key  # conv_in, conv_out, quant_conv, post_quant_conv keep their names


def vae_key_map(diffusers_keys: Iterable[str], prefix: str = VAE_PREFIX) -> dict[str, str]:
    """{diffusers key: full LDM key} for every key of a diffusers VAE state dict."""
    keys = list(diffusers_keys)
    num_blocks = len({m[1] for k in keys if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k))})
    return {k: prefix + vae_key_to_ldm(k, num_blocks) for k in keys}


# --- text encoders ------------------------------------------------------------

def _bare_te_key(key: str) -> str:
    # transformers 5 CLIPTextModel has no `text_model.` level; older releases do.
    return key[len("text_model."):] if key.startswith("text_model.") else key


def clip_l_key_map(diffusers_keys: Iterable[str]) -> dict[str, str]:
    """{CLIPTextModel key: LDM key} for SD1's CLIP-L (HF names under `cond_stage_model.transformer.text_model.`)."""
    return {k: CLIP_L_PREFIX + "text_model." + _bare_te_key(k) for k in diffusers_keys
            if not k.endswith("position_ids")}


def open_clip_key_to_ldm(key: str) -> tuple[str, int | None]:
    """Map a CLIPTextModel key of SD2's encoder to (OpenCLIP key, slice index in a fused in_proj or None)."""
    bare = _bare_te_key(key)
    fixed = {"embeddings.token_embedding.weight": "token_embedding.weight",
             "embeddings.position_embedding.weight": "positional_embedding",
             "final_layer_norm.weight": "ln_final.weight", "final_layer_norm.bias": "ln_final.bias"}
    if bare in fixed:
        return OPEN_CLIP_PREFIX + fixed[bare], None
    m = re.match(r"encoder\.layers\.(\d+)\.(.+)", bare)
    if not m:
        raise LayoutError(f"no OpenCLIP name for text encoder key {key}")
    block, rest = f"transformer.resblocks.{m[1]}.", m[2]
    if q := re.match(r"self_attn\.([qkv])_proj\.(weight|bias)", rest):
        return OPEN_CLIP_PREFIX + block + f"attn.in_proj_{q[2]}", "qkv".index(q[1])
    return OPEN_CLIP_PREFIX + block + _rename_head(rest, _OPEN_CLIP_LAYER), None


# --- conversion -----------------------------------------------------------------

def _fit(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reshape between LDM's conv-1x1 and diffusers' linear VAE attention weights."""
    if tensor.shape == shape:
        return tensor
    if tensor.numel() == math.prod(shape) and tensor.shape[:2] == shape[:2]:
        return tensor.reshape(shape)
    raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(shape)}")


def pull(checkpoint: Mapping[str, torch.Tensor], key_map: Mapping[str, str],
         target_shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Build a diffusers state dict from an LDM `checkpoint` through `key_map` (diffusers -> LDM)."""
    out = {}
    for key, ldm_key in key_map.items():
        if ldm_key not in checkpoint:
            raise LayoutError(ldm_key)
        out[key] = _fit(checkpoint[ldm_key], target_shapes[key])
    return out


def pull_open_clip(checkpoint: Mapping[str, torch.Tensor], target_shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Build SD2's CLIPTextModel state dict from OpenCLIP keys, splitting each fused in_proj into q, k, v."""
    out = {}
    for key, shape in target_shapes.items():
        if key.endswith("position_ids"):
            continue
        ldm_key, part = open_clip_key_to_ldm(key)
        if ldm_key not in checkpoint:
            raise LayoutError(ldm_key)
        tensor = checkpoint[ldm_key]
        if part is not None:
            tensor = tensor.chunk(3, dim=0)[part]
        out[key] = _fit(tensor, shape).contiguous()
    return out


def push(state_dict: Mapping[str, torch.Tensor], key_map: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """Rename a diffusers state dict into the LDM layout; VAE attention weights become conv 1x1."""
    out = {}
    for key, tensor in state_dict.items():
        if key not in key_map:
            continue
        ldm_key = key_map[key]
        if ".mid.attn_1." in ldm_key and ldm_key.endswith("weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        out[ldm_key] = tensor.contiguous()
    return out


def push_open_clip(state_dict: Mapping[str, torch.Tensor], lazy: bool = False) -> dict[str, Any]:
    """SD2's CLIPTextModel state dict in OpenCLIP layout, with the parts real SD2 files also hold.

    diffusers keeps 23 of OpenCLIP-H's 24 layers; like sd-scripts we write a copy of
    the last layer as the 24th, plus text_projection and logit_scale, so other tools
    accept the file. The loader ignores all three. With `lazy`, the fused in_proj
    tensors and the copied layer are Deferred (made when written).
    """
    out: dict[str, Any] = {}
    fused: dict[str, list] = {}
    for key, tensor in state_dict.items():
        if key.endswith("position_ids"):
            continue
        ldm_key, part = open_clip_key_to_ldm(key)
        if part is None:
            out[ldm_key] = tensor.contiguous()
        else:
            fused.setdefault(ldm_key, [None, None, None])[part] = tensor
    for ldm_key, parts in fused.items():
        out[ldm_key] = concat(parts) if lazy else torch.cat(parts, dim=0)
    last = max(int(m[1]) for k in out if (m := re.match(re.escape(OPEN_CLIP_PREFIX) + r"transformer\.resblocks\.(\d+)\.", k)))
    src, dst = f"{OPEN_CLIP_PREFIX}transformer.resblocks.{last}.", f"{OPEN_CLIP_PREFIX}transformer.resblocks.{last + 1}."
    for k in [k for k in out if k.startswith(src)]:
        t = out[k]
        copy = Deferred(lambda t=t: materialized(t).clone(), t.shape, t.dtype) if lazy else t.clone()
        out[dst + k[len(src):]] = copy
    width = out[OPEN_CLIP_PREFIX + "ln_final.weight"].shape[0]
    dtype = out[OPEN_CLIP_PREFIX + "ln_final.weight"].dtype
    out[OPEN_CLIP_PREFIX + "text_projection"] = torch.eye(width, dtype=dtype)
    out[OPEN_CLIP_PREFIX + "logit_scale"] = torch.tensor(math.log(100.0), dtype=dtype)
    return out


def normalize_checkpoint(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bring older SD1 files (CLIP keys without `text_model.`) to the current layout."""
    out = {}
    for key, tensor in checkpoint.items():
        if key.startswith(CLIP_L_PREFIX) and not key.startswith(CLIP_L_PREFIX + "text_model."):
            key = CLIP_L_PREFIX + "text_model." + key[len(CLIP_L_PREFIX):]
        out[key] = tensor
    return out


def diffusers_to_ldm(unet_sd: Mapping[str, torch.Tensor], vae_sd: Mapping[str, torch.Tensor],
                     text_encoder_sd: Mapping[str, torch.Tensor], v2: bool, layers_per_block: int = 2,
                     lazy: bool = False) -> dict[str, Any]:
    """One LDM-layout state dict (as in an SD1 / SD2 `.safetensors` / `.ckpt`) from the three parts
    (`lazy`: derived tensors Deferred, see push_open_clip)."""
    out = push(unet_sd, unet_key_map(unet_sd.keys(), layers_per_block))
    out.update(push(vae_sd, vae_key_map(vae_sd.keys())))
    if v2:
        out.update(push_open_clip(text_encoder_sd, lazy))
    else:
        out.update(push(text_encoder_sd, clip_l_key_map(text_encoder_sd.keys())))
    return out
