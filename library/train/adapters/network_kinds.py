"""The one seam between the loop and a --network_module: the project's own LoRA, LyCORIS, or any module with
sd-scripts' `create_network` / `create_network_from_weights`. `network_kind(name)` chooses once; nothing else
asks which module it is.

- OwnLoRA (networks.lora): built from the family's LoRA targets, so its modules already carry kohya names.
- ExternalNetwork: modules name themselves by raw module paths; files are renamed to kohya names on save and
  back on load (network_setup.kohya_name_map), so ComfyUI, A1111 and diffusers read them.
- LycorisNetwork: an ExternalNetwork whose presets are fitted to the family's model (aliases for BFL block
  classes, no names inside targeted classes) and registered in LyCORIS' own preset table (its public
  `lycoris.config.PRESET`) under a name passed as `preset=`; bypass mode over a float8 base.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from types import ModuleType
from typing import Any, Optional

from library.core.errors import ConfigError
from library.families import family_names, get_family, registered_families
from library.families.base import Components, ModelFamily
from library.train.adapters.network_setup import (
    external_state_dict,
    kohya_name_map,
    preset_with_aliases,
    without_names_inside_targets,
)
from library.train.settings import NetworkOptions

logger = logging.getLogger(__name__)

# Where to get network modules that are not part of this toolkit.
KNOWN_PACKAGES = {"lycoris": "lycoris-lora"}
OWN_LORA = "networks.lora"
LLLITE = "networks.control_net_lllite"  # ControlNet-LLLite (sdxl_train_control_net_lllite.py)
# sd-scripts' per-family LoRA modules; here every one of them names the project's LoRA (networks.lora),
# so sd-scripts command lines (FLUX.1: --network_module networks.lora_flux) run unchanged. Saved files
# record the family's own name (ModelFamily.lora_network_module), as sd-scripts' files do.
def own_lora_names() -> tuple[str, ...]:
    """networks.lora and every registered family's `lora_network_module`, each once."""
    names = [OWN_LORA]
    for family in registered_families():
        if family.lora_network_module not in names:
            names.append(family.lora_network_module)
    return tuple(names)


def is_own_lora(name: str) -> bool:
    """Whether --network_module `name` is the project's LoRA (networks.lora or one of sd-scripts' per-family names)."""
    if name == OWN_LORA:
        return True
    if not name.startswith(OWN_LORA + "_"):
        return False  # LyCORIS or another package: no family is imported to say so
    suffix = name[len(OWN_LORA) + 1:]  # sd-scripts' names end in the family's name: look there first
    if suffix in family_names() and get_family(suffix).lora_network_module == name:
        return True
    return name in own_lora_names()


def import_network_module(name: str) -> ModuleType:
    """Import a --network_module; it must define create_network."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = name.split(".")[0]
        if e.name is not None and not (name == e.name or name.startswith(e.name + ".")):
            raise  # the module exists but one of its own imports is missing: show the real error
        hint = (f"; pip install {KNOWN_PACKAGES[top]} (or, in this repository: pip install .[{top}])"
                if top in KNOWN_PACKAGES else "")
        raise ConfigError(f"--network_module {name}: not installed{hint}") from None
    if not hasattr(module, "create_network"):
        raise ConfigError(f"--network_module {name}: expected a module defining create_network(), "
                          f"e.g. networks.lora")
    return module


class NetworkKind:
    """How the loop creates, loads and names the networks of one --network_module."""
    own = False  # whether its modules carry kohya names themselves (no renaming on save/load)
    conditioning_images = False  # whether it trains on image / conditioning-image pairs (conditioning_data_dir)

    def __init__(self, name: str, module: ModuleType):
        self.name = name
        self.module = module

    def create_kwargs(self, family: ModelFamily, components: Components, opts: NetworkOptions,
                      fp8_base: bool) -> dict[str, Any]:
        """Keyword arguments for create_network beyond the sd-scripts positional ones."""
        return dict(opts.network_args)

    def file_kwargs(self, path: str, family: ModelFamily, components: Components) -> dict[str, Any]:
        """Keyword arguments for create_network_from_weights(path): the file's tensors in the module's naming."""
        return {"weights_sd": external_state_dict(path, family, components)}

    def name_map(self, family: ModelFamily, components: Components) -> Optional[dict[str, str]]:
        """Module name -> kohya name for saving (None: the names are kohya names already)."""
        return kohya_name_map(family.lora_targets(components))

    def metadata_module(self, family: ModelFamily) -> str:
        """What saved files record as ss_network_module: the module name as given."""
        return self.name

    def create(self, family: ModelFamily, components: Components, opts: NetworkOptions, fp8_base: bool = False) -> Any:
        """create_network with the --network_* options; a module's own argument errors become one line."""
        kwargs = self.create_kwargs(family, components, opts, fp8_base)
        try:
            return self.module.create_network(opts.network_multiplier, opts.network_dim, opts.network_alpha,
                                              components.vae, text_encoders_arg(components), components.denoiser,
                                              neuron_dropout=opts.network_dropout, **kwargs)
        except (ValueError, KeyError) as exc:  # e.g. LyCORIS: an unknown algo, a rank BOFT cannot factor
            raise ConfigError(f"--network_module {opts.network_module} --network_args "
                              f"{' '.join(f'{k}={v}' for k, v in opts.network_args.items())}: {exc}") from exc

    def create_from_file(self, family: ModelFamily, components: Components, path: str, multiplier: float,
                         for_inference: bool = False, **extra: Any) -> tuple[Any, Any]:
        """create_network_from_weights over a saved file: (network, its weights)."""
        kwargs = {**self.file_kwargs(path, family, components), **extra}
        if for_inference:
            kwargs["for_inference"] = True
        return self.module.create_network_from_weights(multiplier, path, components.vae, text_encoders_arg(components),
                                                       components.denoiser, **kwargs)


class OwnLoRA(NetworkKind):
    """networks.lora: the family's targets, block layout and kohya names."""
    own = True

    def _family_kwargs(self, family: ModelFamily, components: Components) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"lora_targets": family.lora_targets(components)}
        block_layout = family.lora_block_layout()
        if block_layout is not None:
            kwargs["block_layout"] = block_layout
        return kwargs

    def create_kwargs(self, family, components, opts, fp8_base):
        return {**opts.network_args, **self._family_kwargs(family, components)}

    def file_kwargs(self, path, family, components):
        # the file in the family's naming, e.g. a LyCORIS full-preset SDXL file's lora_unet_conv_in as
        # lora_unet_input_blocks_0_0, so that no module is dropped for its spelling
        return {**self._family_kwargs(family, components), "weights_sd": self.state_dict_in_family_names(family, path)}

    def name_map(self, family, components):
        return None

    def create(self, family, components, opts, fp8_base=False):
        kwargs = self.create_kwargs(family, components, opts, fp8_base)
        return self.module.create_network(opts.network_multiplier, opts.network_dim, opts.network_alpha,
                                          components.vae, text_encoders_arg(components), components.denoiser,
                                          neuron_dropout=opts.network_dropout, **kwargs)

    def metadata_module(self, family: ModelFamily) -> str:
        """The family's sd-scripts module name, whichever alias was given."""
        return family.lora_network_module

    def state_dict_in_family_names(self, family: ModelFamily, path: str) -> dict:
        """A LoRA file's tensors in the family's kohya naming (e.g. a diffusers-named SDXL file renamed)."""
        state = family.convert_lora_state_dict(self.module.load_state_dict(path))
        renamed = {}
        for key, value in state.items():
            name, dot, rest = key.partition(".")
            renamed[family.canonical_lora_name(name) + dot + rest] = value
        return renamed


class OwnLoRAVariant(OwnLoRA):
    """networks.lora_fa (lora_down frozen), networks.dylora (rank trained a unit at a time), networks.oft and
    networks.oft_flux (OFT, under the names sd-scripts' own models give the layers): built from the family's
    targets like networks.lora; files record the module's own name."""

    def metadata_module(self, family: ModelFamily) -> str:
        return self.name


class LLLiteNetwork(NetworkKind):
    """networks.control_net_lllite (ControlNet-LLLite): its modules name themselves by the SGM paths the family's
    UNet target renames to, as sd-scripts' files and ComfyUI's loader have them. It trains on conditioning images."""
    own = True
    conditioning_images = True

    def create_kwargs(self, family, components, opts, fp8_base):
        return {**opts.network_args, "lora_targets": family.lora_targets(components)}

    def file_kwargs(self, path, family, components):
        return {"lora_targets": family.lora_targets(components)}

    def name_map(self, family, components):
        return None


class ExternalNetwork(NetworkKind):
    """Any other module with sd-scripts' create_network / create_network_from_weights."""


class LycorisNetwork(ExternalNetwork):
    """lycoris.kohya: presets fitted to the model, bypass mode over float8 weights."""
    def create_kwargs(self, family, components, opts, fp8_base):
        kwargs = dict(opts.network_args)
        if fp8_base:  # its default path rebuilds W + ΔW in the base weight's dtype, which float8 cannot compute
            if str(kwargs.get("bypass_mode", "true")).lower() in ("false", "0", "no"):
                raise ConfigError("--network_args bypass_mode=False: LyCORIS needs bypass_mode with --fp8_base "
                                  "(it cannot add ΔW to float8 weights); drop the argument")
            kwargs["bypass_mode"] = "True"
        kwargs["preset"] = self._registered_preset(str(kwargs.get("preset", "full")), family, components)
        return kwargs

    def create_from_file(self, family, components, path, multiplier, for_inference=False, **extra):
        """LyCORIS builds a network from its class-wide preset before it reads the file's modules, and throws
        those modules away: with its default `full` preset on a diffusers UNet that first build names
        time_embedding.linear_1 twice and stops ("duplicated lora name"). Build it with an empty preset
        (also faster), then restore the preset."""
        from lycoris.kohya import LycorisNetworkKohya as cls

        saved = {name: getattr(cls, name) for name in _LYCORIS_PRESET_ATTRS}
        cls.apply_preset({"unet_target_module": [], "unet_target_name": [], "text_encoder_target_module": [],
                          "text_encoder_target_name": []})
        try:
            return super().create_from_file(family, components, path, multiplier, for_inference, **extra)
        finally:
            for name, value in saved.items():
                setattr(cls, name, value)

    def _registered_preset(self, preset: str, family: ModelFamily, components: Components) -> str:
        """The name under which the fitted preset is registered in LyCORIS' preset table."""
        from lycoris.config import PRESET
        from lycoris.utils.preset import read_preset

        if preset in PRESET:
            base = PRESET[preset]
        elif os.path.isfile(preset):
            base = read_preset(preset)
        else:
            raise ConfigError(f"--network_args preset={preset}: expected one of {', '.join(sorted(PRESET))} "
                              "or a preset .toml file")
        fitted = without_names_inside_targets(preset_with_aliases(base, family.lycoris_module_aliases),
                                              components.denoiser)
        digest = hashlib.sha256(json.dumps(fitted, sort_keys=True, default=str).encode()).hexdigest()[:12]
        name = f"sd-lora-toolkit:{family.name}:{preset}:{digest}"
        PRESET[name] = fitted
        return name


# The class attributes LycorisNetworkKohya.apply_preset sets.
_LYCORIS_PRESET_ATTRS = ("ENABLE_CONV", "UNET_TARGET_REPLACE_MODULE", "UNET_TARGET_REPLACE_NAME",
                         "TEXT_ENCODER_TARGET_REPLACE_MODULE", "TEXT_ENCODER_TARGET_REPLACE_NAME", "MODULE_ALGO_MAP",
                         "NAME_ALGO_MAP", "USE_FNMATCH", "TARGET_EXCLUDE_NAME")


def network_kind(name: str) -> NetworkKind:
    """The kind of the --network_module `name`, imported once (a one-line ConfigError when it cannot be)."""
    if is_own_lora(name):
        return OwnLoRA(name, import_network_module(OWN_LORA))
    if name == LLLITE:
        return LLLiteNetwork(name, import_network_module(name))
    if name in ("networks.lora_fa", "networks.dylora", "networks.oft", "networks.oft_flux"):
        return OwnLoRAVariant(name, import_network_module(name))
    module = import_network_module(name)
    if name.split(".")[0] == "lycoris":
        return LycorisNetwork(name, module)
    return ExternalNetwork(name, module)


def text_encoders_arg(components: Components) -> Any:
    """The text encoders as sd-scripts' network modules take them: one model, or a list of several."""
    te = components.text_encoders
    return te if len(te) > 1 else te[0]


def build_network(kind: NetworkKind, family: ModelFamily, components: Components, opts: NetworkOptions,
                  fp8_base: bool = False) -> Any:
    """The network to train, from --network_* options (--dim_from_weights: shaped by --network_weights)."""
    if opts.dim_from_weights:  # network_options_from_args checked that --network_weights is given
        extra = kind.create_kwargs(family, components, opts, fp8_base)
        if isinstance(kind, OwnLoRA):
            extra["weights_sd"] = kind.state_dict_in_family_names(family, opts.network_weights)
        network, _ = kind.create_from_file(family, components, opts.network_weights, opts.network_multiplier, **extra)
    else:
        network = kind.create(family, components, opts, fp8_base)
    if network is None:
        raise ConfigError(f"--network_module {opts.network_module}: create_network returned nothing")
    return network


def merge_base_weights(kind: NetworkKind, family: ModelFamily, components: Components, opts: NetworkOptions) -> None:
    """--base_weights: bake each LoRA file into the base model (at its multiplier) before training."""
    for path, multiplier in zip(opts.base_weights, opts.base_weights_multiplier):
        if not os.path.isfile(path):
            raise ConfigError(f"--base_weights {path}: file not found")
        network, weights = kind.create_from_file(family, components, path, multiplier, for_inference=True)
        network.merge_to(text_encoders_arg(components), components.denoiser, weights, components.denoiser.dtype,
                         components.denoiser.device)
        logger.info("merged base weights %s at multiplier %s", path, multiplier)
