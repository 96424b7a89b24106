"""Base models for the LoRA tools: load one through its family, find its LoRA layers by kohya name, save it.

Everything model-specific comes from the family (`family.load`, `family.lora_targets`,
`family.save_checkpoint`), so a new family works with merge, extract and the
recipe resize without changes here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from library.errors import UserError
from library.families import get_family
from library.families.base import Components, LoadOptions, ModelFamily


@dataclass
class LoraLayer:
    """The weight a kohya LoRA name points at: one Linear / Conv2d, or a fused kohya module.

    A fused module (Flux's `img_attn_qkv`, `linear1`) is several diffusers Linears that read
    the same input; `fused` holds them in slot order, and the kohya layer's weight is theirs
    stacked by rows, so ΔW's rows split across them in that order.
    """

    module: nn.Module
    is_text_encoder: bool
    fused: tuple[nn.Module, ...] = ()

    @property
    def members(self) -> tuple[nn.Module, ...]:
        return self.fused or (self.module,)

    @property
    def weight(self) -> torch.Tensor:
        """The layer's weight; for a fused module a (detached) row-stacked copy of its members'."""
        if not self.fused:
            return self.module.weight
        return torch.cat([m.weight.detach() for m in self.fused], dim=0)

    def set_weight(self, value: torch.Tensor) -> None:
        """Replace the weight in place; a fused module's members each take their rows of `value`."""
        start = 0
        for member in self.members:
            rows = member.weight.shape[0]
            member.weight.data = value[start:start + rows].to(member.weight.dtype).reshape(member.weight.shape)
            start += rows


@dataclass
class LoadedModel:
    family: ModelFamily
    components: Components


def load_model(path: str, family_name: str = "sd", dtype: torch.dtype = torch.float32,
               flags: Optional[dict] = None) -> LoadedModel:
    """Load a checkpoint (file, diffusers folder or preset) with the named family.

    `flags`: the family's own flags that loading needs (FLUX.1's --clip_l / --t5xxl / --ae for a BFL file).
    """
    family = get_family(family_name)
    if flags:
        family.configure_from_args(flags)
    components = family.load(LoadOptions(path, dtype=dtype, vae_dtype=dtype))
    return LoadedModel(family, components)


def lora_layers(model: LoadedModel, include_conv: bool = True) -> dict[str, LoraLayer]:
    """Every layer that can carry a LoRA, by kohya module name (conv layers of resnets with include_conv).

    Members of a fused kohya module come as one LoraLayer (see LoraLayer.fused).
    """
    from networks.lora_targets import iter_target_groups

    layers: dict[str, LoraLayer] = {}
    for target in model.family.lora_targets(model.components):
        for name, modules in iter_target_groups(target, include_conv):
            layers[name] = LoraLayer(modules[0], target.is_text_encoder, tuple(modules) if len(modules) > 1 else ())
    return layers


def base_weights(model: LoadedModel) -> dict[str, torch.Tensor]:
    """Weights of the LoRA layers by kohya name (what --base_model recipes compare against)."""
    return {name: layer.weight.detach() for name, layer in lora_layers(model).items()}


def save_model(model: LoadedModel, path: str, dtype: Optional[torch.dtype] = None) -> None:
    """Write the (merged) model: one file for a .safetensors/.ckpt path, otherwise a diffusers folder."""
    try:
        model.family.save_checkpoint(model.components, path, dtype)
    except NotImplementedError as e:
        raise UserError(str(e)) from None
