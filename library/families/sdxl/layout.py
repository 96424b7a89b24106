"""State-dict conversion between diffusers/transformers SDXL parts and the SGM single-file layout.

The layout of `sd_xl_base_1.0.safetensors`: UNet under `model.diffusion_model.`
(LDM names plus `label_emb.0.*` for the size/pool embedding), VAE under
`first_stage_model.` (as SD's), CLIP-L under `conditioner.embedders.0.transformer.`
(HF names) and OpenCLIP-bigG under `conditioner.embedders.1.model.` (OpenCLIP
names: fused attention in_proj, `text_projection` stored transposed). The UNet,
VAE and per-layer text-encoder names are SD's (ldm_layout); this module adds
what SDXL has on top and the SDXL prefixes.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

import torch

from library.core.safetensors_io import Deferred, concat
from library.families.common import ldm_layout as ldm
from library.families.base import ModelLoadError
from library.families.sdxl.configs import SDXL_UP_BLOCKS, TIME_IDS, sdxl_unet_config

UNET_PREFIX = ldm.UNET_PREFIX
VAE_PREFIX = ldm.VAE_PREFIX
TE1_PREFIX = "conditioner.embedders.0.transformer."
TE2_PREFIX = "conditioner.embedders.1.model."
_ADD_EMBEDDING = {"add_embedding.linear_1.": "label_emb.0.0.", "add_embedding.linear_2.": "label_emb.0.2."}
TEXT_PROJECTION = "text_projection.weight"


# --- UNet ------------------------------------------------------------------------

def unet_key_to_sgm(key: str, layers_per_block: int = 2,
                    up_blocks_with_attention: frozenset[int] = frozenset(
                        i for i, t in enumerate(SDXL_UP_BLOCKS) if t.startswith("CrossAttn"))) -> str:
    """One diffusers SDXL UNet key (or module path + ".weight") as its SGM name, without the prefix."""
    for old, new in _ADD_EMBEDDING.items():
        if key.startswith(old):
            return new + key[len(old):]
    return ldm.unet_key_to_ldm(key, layers_per_block, set(up_blocks_with_attention))


def unet_key_map(diffusers_keys: Iterable[str], layers_per_block: int = 2) -> dict[str, str]:
    """{diffusers key: full SGM key} for every key of a diffusers SDXL UNet state dict."""
    keys = list(diffusers_keys)
    with_attention = frozenset(int(m[1]) for k in keys if (m := re.match(r"up_blocks\.(\d+)\.attentions\.", k)))
    return {k: UNET_PREFIX + unet_key_to_sgm(k, layers_per_block, with_attention) for k in keys}


# --- text encoders -------------------------------------------------------------------

def te1_key_map(diffusers_keys: Iterable[str]) -> dict[str, str]:
    """{CLIPTextModel key: SGM key} for CLIP-L (HF names under the SDXL prefix)."""
    return {k: TE1_PREFIX + v[len(ldm.CLIP_L_PREFIX):] for k, v in ldm.clip_l_key_map(diffusers_keys).items()}


def te2_key_to_sgm(key: str) -> tuple[str, int | None]:
    """A CLIPTextModelWithProjection key as (SGM key, slice of the fused in_proj or None)."""
    bare = key[len("text_model."):] if key.startswith("text_model.") else key
    if bare == TEXT_PROJECTION:
        return TE2_PREFIX + "text_projection", None
    sd2_key, part = ldm.open_clip_key_to_ldm(bare)
    return TE2_PREFIX + sd2_key[len(ldm.OPEN_CLIP_PREFIX):], part


def pull_te2(checkpoint: Mapping[str, torch.Tensor], target_shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """OpenCLIP-bigG tensors as a CLIPTextModelWithProjection state dict (in_proj split, projection transposed)."""
    out = {}
    for key, shape in target_shapes.items():
        if key.endswith("position_ids"):
            continue
        sgm_key, part = te2_key_to_sgm(key)
        if sgm_key not in checkpoint:
            raise ldm.LayoutError(sgm_key)
        tensor = checkpoint[sgm_key]
        if part is not None:
            tensor = tensor.chunk(3, dim=0)[part]
        elif key.endswith(TEXT_PROJECTION):
            tensor = tensor.t()  # OpenCLIP computes x @ P; a Linear computes x @ W.T
        if tensor.shape != shape:
            raise ValueError(f"{sgm_key}: shape {tuple(tensor.shape)} does not fit {tuple(shape)}")
        out[key] = tensor.contiguous()
    return out


def push_te2(state_dict: Mapping[str, torch.Tensor], lazy: bool = False) -> dict[str, Any]:
    """A CLIPTextModelWithProjection state dict in the SGM/OpenCLIP layout (plus logit_scale, as real files);
    with `lazy` the fused in_proj and transposed projection are Deferred (made when written)."""
    out: dict[str, Any] = {}
    fused: dict[str, list] = {}
    for key, tensor in state_dict.items():
        if key.endswith("position_ids"):
            continue
        sgm_key, part = te2_key_to_sgm(key)
        if part is not None:
            fused.setdefault(sgm_key, [None, None, None])[part] = tensor
        elif key.endswith(TEXT_PROJECTION):
            out[sgm_key] = Deferred(lambda t=tensor: t.t().contiguous(), tensor.shape[::-1], tensor.dtype) if lazy \
                else tensor.t().contiguous()
        else:
            out[sgm_key] = tensor.contiguous()
    for sgm_key, parts in fused.items():
        out[sgm_key] = concat(parts) if lazy else torch.cat(parts, dim=0)
    dtype = out[TE2_PREFIX + "ln_final.weight"].dtype
    out[TE2_PREFIX + "logit_scale"] = torch.tensor(math.log(100.0), dtype=dtype)
    return out


def diffusers_to_sgm(unet_sd: Mapping[str, torch.Tensor], vae_sd: Mapping[str, torch.Tensor],
                     te1_sd: Mapping[str, torch.Tensor], te2_sd: Mapping[str, torch.Tensor],
                     layers_per_block: int = 2, lazy: bool = False) -> dict[str, Any]:
    """One SGM-layout state dict (as in `sd_xl_base_1.0.safetensors`) from the four parts
    (`lazy`: derived tensors Deferred, see push_te2)."""
    out = ldm.push(unet_sd, unet_key_map(unet_sd.keys(), layers_per_block))
    out.update(ldm.push(vae_sd, ldm.vae_key_map(vae_sd.keys())))
    out.update(ldm.push(te1_sd, te1_key_map(te1_sd.keys())))
    out.update(push_te2(te2_sd, lazy))
    return out


# --- recognising a checkpoint and reading its configs from shapes ------------------------

def check_sdxl_keys(checkpoint: Mapping[str, torch.Tensor], path: str) -> None:
    """ModelLoadError naming what the file is when it is not an SDXL SGM checkpoint."""
    keys = list(checkpoint)
    if any(k.startswith(("double_blocks.", "model.diffusion_model.double_blocks.")) for k in keys):
        raise ModelLoadError(f"{path}: this is a FLUX checkpoint (double_blocks.* keys), not SDXL; "
                             "use flux_train_network.py")
    has_te1 = any(k.startswith(TE1_PREFIX) for k in keys)
    has_te2 = any(k.startswith(TE2_PREFIX) for k in keys)
    if not (has_te1 and has_te2) and any(k.startswith("cond_stage_model.") for k in keys):
        raise ModelLoadError(f"{path}: this is an SD 1.x/2.x checkpoint (cond_stage_model.* keys), not SDXL; "
                             "use train_network.py")
    has_unet = UNET_PREFIX + "label_emb.0.0.weight" in checkpoint
    if not (has_unet and has_te1 and has_te2 and any(k.startswith(VAE_PREFIX) for k in keys)):
        sample = ", ".join(keys[:3]) or "no tensors"
        raise ModelLoadError(f"{path}: not an SDXL checkpoint: expected model.diffusion_model.* (with label_emb), "
                             f"first_stage_model.*, {TE1_PREFIX}* and {TE2_PREFIX}* keys, found {sample}")


def _indices(checkpoint: Mapping[str, torch.Tensor], pattern: str) -> set[int]:
    regex = re.compile(pattern)
    return {int(m[1]) for k in checkpoint if (m := regex.match(k))}


def infer_unet_config(ckpt: Mapping[str, torch.Tensor]) -> dict:
    """SDXL UNet2DConditionModel kwargs read from the shapes of SGM UNet tensors."""
    p = re.escape(UNET_PREFIX)
    down_at = sorted(_indices(ckpt, p + r"input_blocks\.(\d+)\.0\.op\.weight$"))
    if not down_at:
        raise ModelLoadError("SDXL checkpoint UNet has no downsampling blocks")
    layers = down_at[0] - 1
    per, n_levels = layers + 1, len(down_at) + 1
    channels = tuple(ckpt[f"{UNET_PREFIX}input_blocks.{per * i + 1}.0.out_layers.3.weight"].shape[0]
                     for i in range(n_levels))
    depth = tuple(max(1, len(_indices(ckpt, p + rf"input_blocks\.{per * i + 1}\.1\.transformer_blocks\.(\d+)\.")))
                  for i in range(n_levels))
    cross_dim = next(v.shape[1] for k, v in ckpt.items() if k.startswith(UNET_PREFIX) and k.endswith("attn2.to_k.weight"))
    pooled = ckpt[TE2_PREFIX + "text_projection"].shape[1]
    adm_in = ckpt[UNET_PREFIX + "label_emb.0.0.weight"].shape[1]
    return sdxl_unet_config(channels, cross_dim, pooled, (adm_in - pooled) // TIME_IDS, transformer_layers=depth,
                            layers_per_block=layers, in_channels=ckpt[UNET_PREFIX + "input_blocks.0.0.weight"].shape[1])


def te1_shapes(ckpt: Mapping[str, torch.Tensor]) -> dict:
    """hidden_size, intermediate_size, num_hidden_layers, vocab_size, max_position_embeddings of CLIP-L."""
    p = TE1_PREFIX + "text_model."
    tokens = ckpt[p + "embeddings.token_embedding.weight"]
    return dict(hidden_size=tokens.shape[1], vocab_size=tokens.shape[0],
                intermediate_size=ckpt[p + "encoder.layers.0.mlp.fc1.weight"].shape[0],
                num_hidden_layers=len(_indices(ckpt, re.escape(p) + r"encoder\.layers\.(\d+)\.")),
                max_position_embeddings=ckpt[p + "embeddings.position_embedding.weight"].shape[0])


def te2_shapes(ckpt: Mapping[str, torch.Tensor]) -> dict:
    """The same numbers for OpenCLIP-bigG, plus projection_dim."""
    p = TE2_PREFIX
    tokens = ckpt[p + "token_embedding.weight"]
    return dict(hidden_size=tokens.shape[1], vocab_size=tokens.shape[0],
                intermediate_size=ckpt[p + "transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                num_hidden_layers=len(_indices(ckpt, re.escape(p) + r"transformer\.resblocks\.(\d+)\.")),
                max_position_embeddings=ckpt[p + "positional_embedding"].shape[0],
                projection_dim=ckpt[p + "text_projection"].shape[1])
