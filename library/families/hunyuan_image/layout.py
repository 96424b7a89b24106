"""HunyuanImage 2.1's original single-file layouts (Tencent's dit/hunyuanimage2.1.safetensors and
vae_2_1, as sd-scripts and ComfyUI load them) and diffusers' names, both ways.

The DiT file fuses q, k and v: `double_blocks.N.img_attn_qkv` / `txt_attn_qkv` (rows q, k, v), the token refiner's
`self_attn_qkv`, and each single block's `linear1` (q, k, v, then the MLP input). The final layer's adaLN holds
(shift, scale) where diffusers' AdaLayerNormContinuous holds (scale, shift). sd-scripts' kohya LoRA names are these
original module paths (`lora_unet_double_blocks_0_img_attn_qkv`); `original_module` maps a diffusers module to its
original one and, for a fused projection, its slot. ComfyUI's whole-model files put the DiT under
`model.diffusion_model.`.

The VAE file uses the original Encoder / Decoder names (`encoder.down.I.block.J`, `.downsample`, `mid.block_1`,
`mid.attn_1.q`, `decoder.up.I.upsample`, `nin_shortcut`); diffusers numbers the resnets and resamplers of all
levels in one list (`down_blocks.K`).
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from library.families.common.dit_layout import count_blocks, swap_halves, to_original_fused

_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks|context_embedder\.token_refiner\.refiner_blocks)"
                    r"\.(\d+)\.(.+)$")
_ORIGINAL_BLOCK = re.compile(r"^(double_blocks|single_blocks|txt_in\.individual_token_refiner\.blocks)\.(\d+)\.(.+)$")
BLOCK_KINDS = {"transformer_blocks": "double_blocks", "single_transformer_blocks": "single_blocks",
               "context_embedder.token_refiner.refiner_blocks": "txt_in.individual_token_refiner.blocks"}
# diffusers module path inside a block -> (original path, slot in a fused projection or None), per block kind
BLOCK_MODULES: dict[str, dict[str, tuple[str, Optional[int]]]] = {
    "transformer_blocks": {
        "norm1.linear": ("img_mod.linear", None), "norm1_context.linear": ("txt_mod.linear", None),
        "attn.to_q": ("img_attn_qkv", 0), "attn.to_k": ("img_attn_qkv", 1), "attn.to_v": ("img_attn_qkv", 2),
        "attn.add_q_proj": ("txt_attn_qkv", 0), "attn.add_k_proj": ("txt_attn_qkv", 1),
        "attn.add_v_proj": ("txt_attn_qkv", 2), "attn.to_out.0": ("img_attn_proj", None),
        "attn.to_add_out": ("txt_attn_proj", None), "attn.norm_q": ("img_attn_q_norm", None),
        "attn.norm_k": ("img_attn_k_norm", None), "attn.norm_added_q": ("txt_attn_q_norm", None),
        "attn.norm_added_k": ("txt_attn_k_norm", None), "ff.net.0.proj": ("img_mlp.fc1", None),
        "ff.net.2": ("img_mlp.fc2", None), "ff_context.net.0.proj": ("txt_mlp.fc1", None),
        "ff_context.net.2": ("txt_mlp.fc2", None)},
    "single_transformer_blocks": {
        "attn.to_q": ("linear1", 0), "attn.to_k": ("linear1", 1), "attn.to_v": ("linear1", 2),
        "proj_mlp": ("linear1", 3), "proj_out": ("linear2", None), "norm.linear": ("modulation.linear", None),
        "attn.norm_q": ("q_norm", None), "attn.norm_k": ("k_norm", None)},
    "context_embedder.token_refiner.refiner_blocks": {
        "norm1": ("norm1", None), "norm2": ("norm2", None), "attn.to_q": ("self_attn_qkv", 0),
        "attn.to_k": ("self_attn_qkv", 1), "attn.to_v": ("self_attn_qkv", 2),
        "attn.to_out.0": ("self_attn_proj", None), "ff.net.0.proj": ("mlp.fc1", None),
        "ff.net.2": ("mlp.fc2", None), "norm_out.linear": ("adaLN_modulation.1", None)},
}
OUTSIDE_MODULES = {
    "x_embedder.proj": "img_in.proj",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "context_embedder_2.norm": "byt5_in.layernorm",
    "context_embedder_2.linear_1": "byt5_in.fc1",
    "context_embedder_2.linear_2": "byt5_in.fc2",
    "context_embedder_2.linear_3": "byt5_in.fc3",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
    "proj_out": "final_layer.linear",
}
_OUTSIDE_BACK = {v: k for k, v in OUTSIDE_MODULES.items()}
_SWAPPED_HALVES = "final_layer.adaLN_modulation.1"  # (shift, scale) here, (scale, shift) in diffusers


def original_module(path: str) -> tuple[str, Optional[int]]:
    """A diffusers module path -> (its original path, slot in the fused projection or None)
    (`single_transformer_blocks.3.proj_mlp` -> (`single_blocks.3.linear1`, 3)); unknown paths come back unchanged."""
    m = _BLOCK.match(path)
    if m:
        hit = BLOCK_MODULES[m[1]].get(m[3])
        if hit is not None:
            return f"{BLOCK_KINDS[m[1]]}.{m[2]}.{hit[0]}", hit[1]
        return path, None
    return OUTSIDE_MODULES.get(path, path), None


def original_path(path: str) -> str:
    return original_module(path)[0]


def fused_slot(path: str) -> Optional[int]:
    return original_module(path)[1]


def to_original(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HunyuanImageTransformer2DModel state dict -> the original file's tensors (projections fused)."""
    def adjust(name: str, leaf: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
        return leaf, swap_halves(value) if name == _SWAPPED_HALVES else value

    return to_original_fused(state, original_module, adjust=adjust, slot_counts=(3, 4),
                             what="q, k, v (and the MLP input)")


def to_diffusers(tensors: Mapping[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """Original DiT tensors (no prefix) -> HunyuanImageTransformer2DModel names; fused projections split at the
    model width `hidden` (a single block's linear1: q, k, v of `hidden` rows each, then the MLP input)."""
    back: dict[str, dict[str, list[tuple[str, Optional[int]]]]] = {}
    for kind, table in BLOCK_MODULES.items():
        for path, (orig, slot) in table.items():
            back.setdefault(BLOCK_KINDS[kind], {}).setdefault(orig, []).append((path, slot))
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        m = _ORIGINAL_BLOCK.match(module)
        if m is None:
            if module == _SWAPPED_HALVES:
                value = swap_halves(value)
            out[f"{_OUTSIDE_BACK.get(module, module)}.{leaf}"] = value
            continue
        kind = next(k for k, v in BLOCK_KINDS.items() if v == m[1])
        targets = back[m[1]].get(m[3])
        if targets is None:  # not a module of this block kind: keep it, the loader reports it as unexpected
            out[f"{kind}.{m[2]}.{m[3]}.{leaf}"] = value
        elif targets[0][1] is None:
            out[f"{kind}.{m[2]}.{targets[0][0]}.{leaf}"] = value
        else:
            sizes = [hidden] * 3 + ([value.shape[0] - 3 * hidden] if len(targets) == 4 else [])
            for (path, slot), part in zip(sorted(targets, key=lambda t: t[1]), torch.split(value, sizes, dim=0)):
                out[f"{kind}.{m[2]}.{path}.{leaf}"] = part
    return out


def infer_shape(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Block counts, width, heads and text widths of an original DiT state dict (no prefix)."""
    hidden = tensors["img_in.proj.weight"].shape[0]
    head_dim = tensors["double_blocks.0.img_attn_q_norm.weight"].shape[0]
    return dict(double=count_blocks(tensors, "double_blocks"), single=count_blocks(tensors, "single_blocks"),
                hidden=hidden, head_dim=head_dim,
                heads=hidden // head_dim, latent_channels=tensors["img_in.proj.weight"].shape[1],
                text_dim=tensors["txt_in.input_embedder.weight"].shape[1],
                byt5_dim=tensors["byt5_in.fc1.weight"].shape[1] if "byt5_in.fc1.weight" in tensors else None,
                refiner=count_blocks(tensors, r"txt_in\.individual_token_refiner\.blocks"))


# --- the VAE -------------------------------------------------------------------------------------------------------

_VAE_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "nin_shortcut": "conv_shortcut"}
_VAE_ATTN = {"norm": "norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "proj"}


def vae_key_map(levels: int, layers_per_block: int, compression: int = 32) -> dict[str, str]:
    """Original VAE module path -> diffusers path, for every resnet / resampler / mid module (conv_in, norm_out and
    conv_out keep their names)."""
    resampling = compression.bit_length() - 1  # log2: one resampler per level below it (not after the last level)
    out: dict[str, str] = {}
    for side, per_level, stage, resampler, flat in (("encoder", layers_per_block, "down", "downsample", "down_blocks"),
                                                    ("decoder", layers_per_block + 1, "up", "upsample", "up_blocks")):
        index = 0
        for level in range(levels):
            for j in range(per_level):
                for orig, new in _VAE_RESNET.items():
                    out[f"{side}.{stage}.{level}.block.{j}.{orig}"] = f"{side}.{flat}.{index}.{new}"
                index += 1
            if level < resampling and level != levels - 1:
                out[f"{side}.{stage}.{level}.{resampler}.conv"] = f"{side}.{flat}.{index}.conv"
                index += 1
        for orig, new in _VAE_RESNET.items():
            out[f"{side}.mid.block_1.{orig}"] = f"{side}.mid_block.resnets.0.{new}"
            out[f"{side}.mid.block_2.{orig}"] = f"{side}.mid_block.resnets.1.{new}"
        for orig, new in _VAE_ATTN.items():
            out[f"{side}.mid.attn_1.{orig}"] = f"{side}.mid_block.attentions.0.{new}"
    return out


def vae_to_original(state: Mapping[str, torch.Tensor], levels: int, layers_per_block: int) -> dict[str, torch.Tensor]:
    """AutoencoderKLHunyuanImage tensors -> the original VAE file's names."""
    back = {v: k for k, v in vae_key_map(levels, layers_per_block).items()}
    out = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        out[f"{back.get(module, module)}.{leaf}"] = value
    return out


def vae_to_diffusers(tensors: Mapping[str, torch.Tensor], levels: int, layers_per_block: int) -> dict[str, torch.Tensor]:
    """Original VAE tensors -> diffusers names; Tencent's 5-D (one-frame) conv weights squeezed to 2-D convs."""
    mapping = vae_key_map(levels, layers_per_block)
    out = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if value.dim() == 5 and value.shape[2] == 1:
            value = value.squeeze(2)
        out[f"{mapping.get(module, module)}.{leaf}"] = value
    return out


# --- ComfyUI's LoRA names ------------------------------------------------------------------------------------------

# sd-scripts' networks/convert_hunyuan_image_lora_to_comfy.py: the module-name endings ComfyUI's HunyuanImage LoRAs
# use instead of sd-scripts' (its MLP and modulation layers are named by index / `lin`).
COMFY_LORA_ENDINGS = {"img_mlp_0": "img_mlp_fc1", "img_mlp_2": "img_mlp_fc2", "img_mod_lin": "img_mod_linear",
                      "txt_mlp_0": "txt_mlp_fc1", "txt_mlp_2": "txt_mlp_fc2", "txt_mod_lin": "txt_mod_linear",
                      "modulation_lin": "modulation_linear"}
_COMFY_LORA_NAME = re.compile(r"^(lora_unet_(?:double|single)_blocks_\d+_)(" + "|".join(COMFY_LORA_ENDINGS) + r")$")


def kohya_lora_name(name: str) -> str:
    """A ComfyUI-named module (`lora_unet_double_blocks_0_img_mlp_0`) in sd-scripts' naming (`..._img_mlp_fc1`);
    other names come back unchanged."""
    m = _COMFY_LORA_NAME.match(name)
    return m[1] + COMFY_LORA_ENDINGS[m[2]] if m else name


_KOHYA_LORA_NAME = re.compile(r"^(lora_unet_(?:double|single)_blocks_\d+_)("
                              + "|".join(COMFY_LORA_ENDINGS.values()) + r")$")
_TO_COMFY = {kohya: comfy for comfy, kohya in COMFY_LORA_ENDINGS.items()}


def is_kohya_lora(names) -> bool:
    """Whether kohya module names are HunyuanImage's own (`..._img_mlp_fc1`, `..._img_mod_linear`, ...: FLUX.1's
    LoRAs name the same layers `img_mlp_0` / `img_mod_lin`, which are ComfyUI's HunyuanImage names)."""
    return any(_KOHYA_LORA_NAME.match(n) for n in names)


def comfy_lora_state(state: dict) -> dict:
    """A kohya HunyuanImage LoRA state dict in ComfyUI's names (as sd-scripts'
    convert_hunyuan_image_lora_to_comfy.py writes them): the same tensors, the MLP / modulation modules renamed."""
    out = {}
    for key, value in state.items():
        name, dot, rest = key.partition(".")
        m = _KOHYA_LORA_NAME.match(name)
        out[(m[1] + _TO_COMFY[m[2]] if m else name) + dot + rest] = value
    return out

