"""SDXL LoRA module names: diffusers paths <-> the SGM names kohya files use, and the 23-block index.

sd-scripts builds SDXL's UNet in the SGM layout, so its LoRA names are SGM
paths (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`). We train
on diffusers' UNet and rename at the name level; the mapping is the one the
single-file converter uses (sgm_layout), applied to module paths.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

from library.families.sdxl.layout import unet_key_to_sgm

UNET_PREFIX = "lora_unet_"
# SDXL's 23 blocks (sd-scripts' block_dims layout): 0 embeddings, 1-9 input_blocks 0-8,
# 10-12 middle_block 0-2, 13-21 output_blocks 0-8, 22 out.
_DIFFUSERS_BLOCK = re.compile(
    r"^(?:(?P<side>down_blocks|up_blocks)_(?P<i>\d+)_|mid_block_)"
    r"(?P<kind>attentions|resnets|downsamplers|upsamplers)_(?P<j>\d+)_(?P<tail>.+)$")
_RESNET_TAILS = ("norm1", "conv1", "time_emb_proj", "norm2", "conv2", "conv_shortcut")
_PEFT_KEY = re.compile(r"^(unet|text_encoder|text_encoder_2)\.(.+)\.(lora_A|lora_B|lora\.down|lora\.up)\.weight$")
# Kohya prefix of each diffusers part.
KOHYA_PREFIX = {"unet": "lora_unet", "text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
_PEFT_PART = {"lora_A": "lora_down", "lora.down": "lora_down", "lora_B": "lora_up", "lora.up": "lora_up"}


def sgm_module_path(path: str) -> str:
    """A dotted module path in diffusers' SDXL UNet as its SGM path (`down_blocks.1.attentions.0.x` -> `input_blocks.4.1.x`)."""
    return unet_key_to_sgm(path + ".weight")[: -len(".weight")]


# The inverse of sgm_module_path, derived from it so the mapping lives once: top-level layers and resnet tails.
_TOP_LAYERS = ("time_embedding.linear_1", "time_embedding.linear_2", "add_embedding.linear_1",
               "add_embedding.linear_2", "conv_in", "conv_out")
_SGM_TOP = {sgm_module_path(p): p for p in _TOP_LAYERS}
_SGM_RESNET = {sgm_module_path(f"mid_block.resnets.0.{t}").split(".", 2)[2]: t for t in _RESNET_TAILS}
# Kohya names (without the prefix) of the top-level layers by diffusers path -> by SGM path.
_DIFFUSERS_TOP = {p.replace(".", "_"): sgm.replace(".", "_") for sgm, p in _SGM_TOP.items()}
_SGM_BLOCK = re.compile(r"^(input_blocks|middle_block|output_blocks)\.(\d+)\.?(\d+)?\.(.+)$")


def diffusers_module_path(path: str) -> str:
    """A module path in SGM naming as its diffusers SDXL UNet path (`input_blocks.4.1.x` -> `down_blocks.1.attentions.0.x`).

    Paths that are not SGM UNet paths (e.g. already diffusers, or SD 1.x/2.x) come back unchanged.
    """
    if path in _SGM_TOP:
        return _SGM_TOP[path]
    m = _SGM_BLOCK.match(path)
    if not m:
        return path
    kind, a, b, rest = m[1], int(m[2]), m[3], m[4]
    if kind == "middle_block":
        return f"mid_block.attentions.0.{rest}" if a == 1 else f"mid_block.resnets.{a // 2}.{_SGM_RESNET.get(rest, rest)}"
    if kind == "input_blocks":
        block, j = (a - 1) // 3, (a - 1) % 3
        if j == 2:
            return f"down_blocks.{block}.downsamplers.0.{'conv' if rest == 'op' else rest}"
        side = "down_blocks"
    else:
        block, j, side = a // 3, a % 3, "up_blocks"
    if int(b) == 0:
        return f"{side}.{block}.resnets.{j}.{_SGM_RESNET.get(rest, rest)}"
    if rest == "conv":
        return f"{side}.{block}.upsamplers.0.conv"
    return f"{side}.{block}.attentions.{j}.{rest}"


def owns_peft_paths(paths: Iterable[str]) -> bool:
    """True when PEFT module paths look like an SDXL LoRA's: a second text encoder, or attention first in down block 1."""
    paths = list(paths)
    return any(p.startswith("text_encoder_2.") for p in paths) or (
        any(".down_blocks.1.attentions." in p for p in paths)
        and not any(".down_blocks.0.attentions." in p for p in paths))


def sgm_lora_name(name: str) -> str:
    """A kohya UNet module name with a diffusers path (`lora_unet_down_blocks_1_...`) in SGM naming.

    Names already in SGM naming, and text-encoder names, come back unchanged.
    """
    if not name.startswith(UNET_PREFIX):
        return name
    rest = name[len(UNET_PREFIX):]
    if rest in _DIFFUSERS_TOP:  # conv_in, conv_out, time_embedding_linear_1, add_embedding_linear_2, ...
        return UNET_PREFIX + _DIFFUSERS_TOP[rest]
    m = _DIFFUSERS_BLOCK.match(rest)
    if not m:
        return name
    block = f"{m['side']}.{m['i']}" if m["side"] else "mid_block"
    dotted, tail = f"{block}.{m['kind']}.{m['j']}", m["tail"]
    if m["kind"] == "resnets" and tail in _RESNET_TAILS:
        path = f"{dotted}.{tail}"
    elif m["kind"].endswith("samplers"):
        path = f"{dotted}.conv"
    else:
        path = f"{dotted}.{tail}"  # inside a transformer: the tail keeps its own underscores
    return UNET_PREFIX + sgm_module_path(path).replace(".", "_")


def is_diffusers_named(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """True when a LoRA state dict names SDXL UNet modules by diffusers paths or uses diffusers/PEFT keys."""
    return any(k.startswith(("lora_unet_down_blocks_", "lora_unet_up_blocks_", "lora_unet_mid_block_"))
               or k.partition(".")[0][len(UNET_PREFIX):] in _DIFFUSERS_TOP and k.startswith(UNET_PREFIX)
               or _PEFT_KEY.match(k) for k in state_dict)


def convert_to_sgm_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers-named SDXL LoRA (kohya keys with diffusers paths, or PEFT `unet.*.lora_A.weight`) in SGM naming.

    PEFT files carry no alpha: each module gets alpha = rank (scale 1), which is
    how diffusers applies them.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        m = _PEFT_KEY.match(key)
        if m:
            path = m[2]
            if m[1] != "unet":
                path = path if path.startswith("text_model.") else "text_model." + path
            name = f"{KOHYA_PREFIX[m[1]]}_{path.replace('.', '_')}"
            part = _PEFT_PART[m[3]]
            out[f"{sgm_lora_name(name)}.{part}.weight"] = value
            if part == "lora_down":
                out.setdefault(f"{sgm_lora_name(name)}.alpha", torch.tensor(float(value.shape[0])))
            continue
        name, _, rest = key.partition(".")
        out[f"{sgm_lora_name(name)}.{rest}"] = value
    return out




