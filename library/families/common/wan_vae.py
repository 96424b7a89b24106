"""The Qwen-Image VAE (diffusers' AutoencoderKLQwenImage, a Wan 2.1 VAE) in the two layouts users have it in.

- Wan 2.1 names, as ComfyUI's `qwen_image_vae.safetensors` holds them (the same as `wan_2.1_vae.safetensors`):
  `encoder.conv1`, `encoder.downsamples.N.residual.0.gamma`, `decoder.middle.1.to_qkv`, `decoder.upsamples.N`,
  `decoder.head.2`, `conv1` / `conv2` (quant / post-quant convs);
- diffusers' names, as the Qwen/Qwen-Image repo's `vae/diffusion_pytorch_model.safetensors` holds them:
  `encoder.conv_in`, `encoder.down_blocks.N.norm1.gamma`, `decoder.up_blocks.L.resnets.R`, `quant_conv`.

Both lists are flat in the encoder (each level's resnets, then its downsampler); the decoder's diffusers up_blocks
group each level's resnets and its upsampler, which Wan lists flat. The mapping is read from the keys, so it holds
for any depth (the tiny presets have 1 or 2 resnets a level; diffusers' own `convert_wan_vae_to_diffusers` knows
only Wan 2.1's 2). Used by Anima (which reads the Qwen-Image VAE) and Qwen-Image / Qwen-Image-Edit.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from library.families.common.loading import read_file

WAN_MARKER = "encoder.conv1.weight"  # ComfyUI's / Wan 2.1's layout
DIFFUSERS_MARKER = "encoder.conv_in.weight"  # diffusers' AutoencoderKLQwenImage layout
EXPECTED = ("the Qwen-Image VAE in Wan 2.1 / ComfyUI names (qwen_image_vae.safetensors: encoder.conv1, "
            "decoder.upsamples.*) or diffusers' names (vae/diffusion_pytorch_model.safetensors: encoder.conv_in, "
            "decoder.up_blocks.*)")

# diffusers' resnet parts -> Wan's (Wan's residual is one Sequential: RMS norm, SiLU, conv, RMS norm, SiLU, dropout,
# conv)
_RESNET_WAN = (("norm1", "residual.0"), ("conv1", "residual.2"), ("norm2", "residual.3"), ("conv2", "residual.6"),
               ("conv_shortcut", "shortcut"))


def vae_layout(keys) -> Optional[str]:
    """"wan", "diffusers" or None (neither) for a VAE file's tensor names."""
    keys = set(keys)
    if WAN_MARKER in keys:
        return "wan"
    if DIFFUSERS_MARKER in keys:
        return "diffusers"
    return None


def _rename(rest: str, pairs) -> str:
    for a, b in pairs:
        if rest.startswith(a + "."):
            return b + rest[len(a):]
    return rest


def up_block_resnets(keys) -> int:
    """Resnets in each diffusers decoder up block (num_res_blocks + 1: 3 in Qwen-Image's VAE)."""
    found = {int(m[1]) for k in keys if (m := re.match(r"decoder\.up_blocks\.0\.resnets\.(\d+)\.", k))}
    return max(found) + 1 if found else 3


def vae_key_to_wan(key: str, up_resnets: int = 3) -> str:
    """An AutoencoderKLQwenImage key -> its Wan 2.1 / ComfyUI name; `up_resnets`: resnets in each decoder up block
    (up_block_resnets; Qwen-Image's 3)."""
    for new, old in (("quant_conv.", "conv1."), ("post_quant_conv.", "conv2.")):
        if key.startswith(new):
            return old + key[len(new):]
    side, _, rest = key.partition(".")
    for new, old in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
        if rest.startswith(new):
            return f"{side}.{old}{rest[len(new):]}"
    stride = up_resnets + 1  # each up block's resnets, then its upsampler
    if m := re.match(r"mid_block\.(resnets|attentions)\.(\d)\.(.*)", rest):
        index = 1 if m[1] == "attentions" else 2 * int(m[2])
        return f"{side}.middle.{index}.{_rename(m[3], _RESNET_WAN) if m[1] == 'resnets' else m[3]}"
    if m := re.match(r"down_blocks\.(\d+)\.(.*)", rest):
        return f"{side}.downsamples.{m[1]}.{_rename(m[2], _RESNET_WAN)}"
    if m := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):
        return f"{side}.upsamples.{stride * int(m[1]) + int(m[2])}.{_rename(m[3], _RESNET_WAN)}"
    if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", rest):
        return f"{side}.upsamples.{stride * int(m[1]) + up_resnets}.{m[2]}"
    return key


def to_wan(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An AutoencoderKLQwenImage state dict in Wan 2.1 / ComfyUI names (what qwen_image_vae.safetensors holds)."""
    up_resnets = up_block_resnets(state_dict)
    return {vae_key_to_wan(k, up_resnets): v for k, v in state_dict.items()}


def _upsample_names(keys) -> dict[int, str]:
    """Wan's flat decoder.upsamples index -> diffusers' `up_blocks.L.resnets.R` / `up_blocks.L.upsamplers.0`: each
    level's resnets run until its upsampler (the index holding `resample.` / `time_conv.`)."""
    parts: dict[int, set[str]] = {}
    for k in keys:
        if m := re.match(r"decoder\.upsamples\.(\d+)\.([a-z_]+)\.", k):
            parts.setdefault(int(m[1]), set()).add(m[2])
    names, level, resnet = {}, 0, 0
    for index in sorted(parts):
        if parts[index] & {"resample", "time_conv"}:
            names[index] = f"up_blocks.{level}.upsamplers.0"
            level, resnet = level + 1, 0
        else:
            names[index] = f"up_blocks.{level}.resnets.{resnet}"
            resnet += 1
    return names


def wan_to_diffusers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan 2.1 / ComfyUI VAE tensors in AutoencoderKLQwenImage's names (the inverse of to_wan)."""
    resnet_parts = tuple((b, a) for a, b in _RESNET_WAN)
    ups = _upsample_names(tensors)
    out = {}
    for key, value in tensors.items():
        side, _, rest = key.partition(".")
        new = key
        if side in ("conv1", "conv2") and rest in ("weight", "bias"):
            new = f"{'quant_conv' if side == 'conv1' else 'post_quant_conv'}.{rest}"
        elif side in ("encoder", "decoder"):
            if m := re.match(r"(conv1|head\.0|head\.2)\.(.*)", rest):
                part = {"conv1": "conv_in", "head.0": "norm_out", "head.2": "conv_out"}[m[1]]
                new = f"{side}.{part}.{m[2]}"
            elif m := re.match(r"middle\.(\d)\.(.*)", rest):
                index = int(m[1])
                new = (f"{side}.mid_block.attentions.0.{m[2]}" if index == 1 else
                       f"{side}.mid_block.resnets.{index // 2}.{_rename(m[2], resnet_parts)}")
            elif m := re.match(r"downsamples\.(\d+)\.(.*)", rest):
                new = f"{side}.down_blocks.{m[1]}.{_rename(m[2], resnet_parts)}"
            elif (m := re.match(r"upsamples\.(\d+)\.(.*)", rest)) and int(m[1]) in ups:
                name = ups[int(m[1])]
                new = f"{side}.{name}.{m[2] if 'upsamplers' in name else _rename(m[2], resnet_parts)}"
        out[new] = value
    return out


def read_vae_tensors(label: str, path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Qwen-Image VAE file's tensors in diffusers' names, from either layout (told by its keys); a file of neither
    is named in one line before any weight is read."""
    tensors = read_file(label, path, EXPECTED, lambda keys: vae_layout(keys) is not None, dtype)
    return wan_to_diffusers(tensors) if vae_layout(tensors) == "wan" else tensors
