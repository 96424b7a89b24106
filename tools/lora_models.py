"""Base models for the LoRA tools: load one through its family, find its LoRA layers by kohya name, save it.

Everything model-specific comes from the family (`family.load`, `family.lora_targets`,
`family.save_checkpoint`), so a new family works with merge, extract and the
recipe resize without changes here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, TypeVar

import torch

from library.cli.options import options_from_values
from library.core.errors import UserError
from library.core.io_utils import clean_stale_temporaries_of
from library.families import DEFAULT_FAMILY, get_family
from library.families.base import Components, LoadOptions, ModelFamily
from library.families.detect import detect_family
from networks.lora_targets import LoraLayer

T = TypeVar("T")


@dataclass
class LoadedModel:
    family: ModelFamily
    components: Components


def load_model(path: str, family_name: Optional[str] = None, dtype: torch.dtype = torch.float32,
               flags: Optional[dict] = None) -> LoadedModel:
    """Load a checkpoint (file, diffusers folder or preset) with the named family; None: the family the file's
    keys (or the folder's config) show, else sd.

    `flags`: the family's own flags that loading needs (FLUX.1's --clip_l / --t5xxl / --ae for a BFL file).
    """
    family = get_family(family_name or detect_family(path) or DEFAULT_FAMILY)
    options = options_from_values(family.options_type, flags or {})
    components = family.load(LoadOptions(path, dtype=dtype, vae_dtype=dtype, family_options=options))
    return LoadedModel(family, components)


def lora_layers(model: LoadedModel, include_conv: bool = True, file_only: bool = True) -> dict[str, LoraLayer]:
    """Every layer that can carry a LoRA, by kohya module name (conv layers of resnets with include_conv).

    Members of a fused kohya module come as one LoraLayer (see LoraLayer.fused). `file_only`: also the
    layers only a file names (a UNet's conv_in, conv_out, time embeddings: LyCORIS preset=full), which a
    tool reading a file needs and extraction, which writes what networks.lora trains, does not.
    """
    from networks.lora_targets import FROM_FILE_ONLY, iter_target_groups

    layers: dict[str, LoraLayer] = {}
    for target in model.family.lora_targets(model.components):
        if not file_only and target.enabled_by == FROM_FILE_ONLY:
            continue
        for name, modules in iter_target_groups(target, include_conv):
            layers[name] = LoraLayer(modules[0], target.is_text_encoder, tuple(modules) if len(modules) > 1 else ())
    return layers


def base_weights(model: LoadedModel) -> dict[str, torch.Tensor]:
    """Weights of the LoRA layers by kohya name (what --base_model recipes compare against)."""
    return {name: layer.weight.detach() for name, layer in lora_layers(model).items()}


def in_family_names(model: LoadedModel, modules: Mapping[str, T]) -> dict[str, T]:
    """A LoRA file's modules by the family's kohya names (`lora_layers` keys): a LyCORIS full-preset SDXL
    file's `lora_unet_conv_in` is `lora_unet_input_blocks_0_0` here. Names the family does not know stay."""
    return {model.family.canonical_lora_name(_lora_name(name)): module for name, module in modules.items()}


def _lora_name(name: str) -> str:
    """sd-scripts' networks.oft names its modules `oft_unet_<path>`, the layer that `lora_unet_<path>` names."""
    from networks.lycoris_delta import lora_module_name

    return lora_module_name(name)


def base_weights_for(model: LoadedModel, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """base_weights keyed by a LoRA file's own module names (those the model has a layer for)."""
    weights = base_weights(model)
    out = {}
    for name in names:
        canonical = model.family.canonical_lora_name(_lora_name(name))
        if canonical in weights:
            out[name] = weights[canonical]
    return out


def save_model(model: LoadedModel, path: str, dtype: Optional[torch.dtype] = None) -> None:
    """Write the (merged) model: one file for a .safetensors/.ckpt path, otherwise a diffusers folder."""
    clean_stale_temporaries_of(path)
    try:
        model.family.save_checkpoint(model.components, path, dtype)
    except NotImplementedError as e:
        raise UserError(str(e)) from None


def load_adapter_file(path: str):
    """Any adapter file the tools take: a LoRA in a known layout (library.families.lora_convert.load_lora_file),
    or a LyCORIS file (LoHa, LoKr, DoRA, OFT, IA3, ...) whose modules compute ΔW with LyCORIS' own code."""
    from library.families.lora_convert import load_lora_file
    from networks.lora_files import read_state_dict
    from networks.lycoris_delta import is_lycoris_state, load_lycoris_file

    state, metadata = read_state_dict(path)
    if state and is_lycoris_state(state):
        return load_lycoris_file(path, state, metadata)
    return load_lora_file(path)


def plain_modules(lora, bases: Optional[Mapping[str, torch.Tensor]] = None) -> dict:
    """A loaded file's modules as plain LoRA modules; a LyCORIS module becomes its exact ΔW as factors
    (`bases`: base weights by name, for DoRA / OFT / IA3, whose ΔW depends on them)."""
    if lora.layout != "lycoris":
        return dict(lora.modules)
    from networks.lycoris_delta import exact_loras

    return exact_loras(lora.modules, bases)
