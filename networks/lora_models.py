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
    """A Linear / Conv2d that a kohya LoRA name points at."""

    module: nn.Module
    is_text_encoder: bool

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight


@dataclass
class LoadedModel:
    family: ModelFamily
    components: Components


def load_model(path: str, family_name: str = "sd", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a checkpoint (file, diffusers folder or preset) with the named family."""
    family = get_family(family_name)
    components = family.load(LoadOptions(path, dtype=dtype, vae_dtype=dtype))
    return LoadedModel(family, components)


def lora_layers(model: LoadedModel, include_conv: bool = True) -> dict[str, LoraLayer]:
    """Every layer that can carry a LoRA, by kohya module name (conv layers of resnets with include_conv)."""
    from networks.lora import iter_target_modules

    layers: dict[str, LoraLayer] = {}
    for target in model.family.lora_targets(model.components):
        for name, module in iter_target_modules(target, include_conv):
            layers[name] = LoraLayer(module, target.is_text_encoder)
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
