"""Building the trainable network (ours or any sd-scripts-style module) and saving it with metadata."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from library.core.errors import ConfigError
from library.core.io_utils import atomic_path, save_safetensors_atomic
from library.families.base import Components, ModelFamily
from networks.lora import LoRANetwork, load_state_dict

logger = logging.getLogger(__name__)

SAVE_DTYPES = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def load_network_weights(network, family: ModelFamily, path: str, name_map: Optional[dict[str, str]] = None) -> Any:
    """--network_weights: load a LoRA file into the network, renamed to the family's naming first if needed.

    Only our own networks.lora uses the family's kohya naming, so only it gets the
    renamed state dict; any other network module loads the file as it is, or, given the
    `name_map` it was saved with (kohya_name_map), with those renames undone first.
    """

    if name_map and not isinstance(network, LoRANetwork):
        state = _renamed(load_state_dict(path), _inverse(name_map))
        info = network.load_state_dict(state, strict=False)
        if state and len(info.unexpected_keys) == len(state):  # nothing loaded: do not train on from scratch
            raise ConfigError(f"--network_weights {path}: none of its {len(state)} tensors fits this network "
                              f"(e.g. {info.unexpected_keys[0]}); was it trained with other --network_args or "
                              "another model?")
        if info.unexpected_keys:
            logger.warning("--network_weights %s: %d tensors fit no module of this network (e.g. %s)", path,
                           len(info.unexpected_keys), info.unexpected_keys[0])
        return info
    if not isinstance(network, LoRANetwork):
        return network.load_weights(path)
    state_dict = load_state_dict(path)
    converted = family.convert_lora_state_dict(state_dict)
    if converted is not state_dict:
        logger.info("%s: diffusers-named LoRA, renamed to %s naming", path, family.name)
    return network.load_weights(converted, source=path)


def optimizer_groups(network, opts, default_lr: float, kind=None, components: Optional[Components] = None
                     ) -> tuple[list, list[str]]:
    """Parameter groups and their names; accepts both the (groups, names) and the bare-list API.

    --text_encoder_lr may hold one rate per text encoder. Our LoRA takes the list; other modules
    (LyCORIS) take one number, so they get the first and, when the rates differ, their text-encoder
    groups are split by encoder afterwards, so two rates work for every module.
    """
    te_lr = list(opts.text_encoder_lr or []) or None
    own = kind is None or kind.own
    result = network.prepare_optimizer_params(te_lr if own or te_lr is None else te_lr[0], opts.unet_lr, default_lr)
    if isinstance(result, tuple):
        groups, names = result
    else:
        groups, names = result, []
    if not names or len(names) != len(groups):
        names = [f"group{i}" for i in range(len(groups))]
    if not own and te_lr and len(set(te_lr)) > 1 and components is not None:
        groups, names = _split_text_encoder_groups(groups, names, network, components, te_lr)
    if not groups:
        raise ConfigError("nothing to train: every parameter group has learning rate 0 "
                          "(check --unet_lr / --text_encoder_lr / --network_train_*_only)")
    return groups, names


def _split_text_encoder_groups(groups: list, names: list[str], network, components: Components,
                               rates: list[float]) -> tuple[list, list[str]]:
    """Groups made only of text-encoder adapter parameters, split by encoder at that encoder's rate."""
    encoder_of = {id(p): enc for lora, enc in _text_encoder_adapters(network, components) for p in lora.parameters()}
    out_groups, out_names = [], []
    for group, name in zip(groups, names):
        params = list(group["params"])
        if not params or not all(id(p) in encoder_of for p in params):
            out_groups.append(group)
            out_names.append(name)
            continue
        for enc in sorted({encoder_of[id(p)] for p in params}):
            lr = rates[min(enc, len(rates) - 1)]
            if lr:
                out_groups.append({**group, "params": [p for p in params if encoder_of[id(p)] == enc], "lr": lr})
                out_names.append(f"textencoder {enc + 1}")
    return out_groups, out_names


ADAPTABLE_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Embedding, torch.nn.LayerNorm,
                    torch.nn.GroupNorm)


def kohya_name_map(targets) -> dict[str, str]:
    """Module names an external network (e.g. lycoris.kohya) derives from raw module paths -> kohya names.

    External modules name a LoRA `prefix_` + its module path; where the family renames paths
    (transformers 5's CLIP has no `text_model.` level; SDXL uses SGM block names) the file
    must still carry the names ComfyUI, A1111 and diffusers expect. A model whose kohya layout
    fuses modules (Flux's `img_attn_qkv`, `linear1`) keeps the raw paths under that target, all
    of them so the file has one naming, behind the target's `external_prefix` when it has one:
    an external network wraps q, k and v apart and has no shared factor to fuse them by (LoHa, LoKr, ...).
    """
    fused_prefixes = {target.prefix for target in targets if target.fused_slot is not None}
    mapping: dict[str, str] = {}
    for target in targets:
        if target.fused_slot is not None and target.external_prefix:
            for path, module in target.root.named_modules():
                if path and _can_carry_adapter(module):
                    raw = path.replace(".", "_")
                    mapping[f"{target.prefix}_{raw}"] = f"{target.external_prefix}_{raw}"
            continue
        if target.rename is None or target.prefix in fused_prefixes:
            continue
        for path, module in target.root.named_modules():
            if not path or not _can_carry_adapter(module):
                continue
            src = f"{target.prefix}_{path.replace('.', '_')}"
            dst = f"{target.prefix}_{target.rename(path).replace('.', '_')}"
            if src != dst:
                mapping[src] = dst
    return mapping


def _can_carry_adapter(module: torch.nn.Module) -> bool:
    """Whether an external network may wrap `module`: a layer with weights of its own.

    Parameterless modules (SDXL's time_proj, activations) have no name in the kohya layout.
    The class test keeps layers whose weight an adapter took over (LyCORIS `full` deletes it).
    """
    return isinstance(module, ADAPTABLE_LAYERS) or next(module.parameters(recurse=False), None) is not None


def external_state_dict(path: str, family: ModelFamily, components: Components) -> dict:
    """A file an external network saved (kohya names, see kohya_name_map) with its raw module names back."""
    return _renamed(load_state_dict(path), _inverse(kohya_name_map(family.lora_targets(components))))


def preset_with_aliases(preset: dict, aliases: tuple[tuple[str, str], ...]) -> dict:
    """A LyCORIS preset whose target classes (and per-class algo overrides) also name each alias class."""
    out = dict(preset)
    for key in ("unet_target_module", "text_encoder_target_module"):
        if key in out:
            names = list(out[key])
            names += [alias for name, alias in aliases if name in names and alias not in names]
            out[key] = names
    if "module_algo_map" in out:
        algo_map = dict(out["module_algo_map"])
        algo_map.update({alias: algo_map[name] for name, alias in aliases if name in algo_map})
        out["module_algo_map"] = algo_map
    return out


def without_names_inside_targets(preset: dict, denoiser) -> dict:
    """The preset without the `unet_target_name` entries that lie inside a module of a targeted class.

    LyCORIS' "full" preset names both the class TimestepEmbedding and its layers
    `time_embedding.linear_1/2`; on a diffusers UNet both match, LyCORIS creates the module
    twice and stops on its own duplicate-name assertion. Wrapped once, via the class, is the intent.
    """
    names, classes = preset.get("unet_target_name"), set(preset.get("unet_target_module", ()))
    if not names or denoiser is None:
        return preset
    inside = {path for path, m in denoiser.named_modules() if path and type(m).__name__ in classes}
    kept = [n for n in names if not any(n == p or n.startswith(p + ".") for p in inside)]
    return preset if len(kept) == len(names) else {**preset, "unet_target_name": kept}


def _inverse(name_map: dict[str, str]) -> dict[str, str]:
    return {dst: src for src, dst in name_map.items()}


def _renamed(state: dict, name_map: dict[str, str]) -> dict:
    out = {}
    for key, value in state.items():
        module, dot, rest = key.partition(".")
        out[name_map.get(module, module) + dot + rest] = value
    return out


def save_network(network, path: str, save_precision: Optional[str], metadata: Optional[dict],
                 name_map: Optional[dict[str, str]] = None) -> None:
    """Save atomically; safetensors through the network's own save_weights, ckpt/pt via torch.save.

    `name_map` renames modules of external networks to kohya names (see kohya_name_map).
    """
    dtype = SAVE_DTYPES[save_precision]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".safetensors"):
        with atomic_path(path) as tmp:
            network.save_weights(tmp, dtype, metadata)
            if name_map:
                from safetensors import safe_open

                with safe_open(tmp, "pt") as f:
                    saved_metadata = f.metadata()
                    state = {k: f.get_tensor(k) for k in f.keys()}
                save_safetensors_atomic(_renamed(state, name_map), tmp, saved_metadata)  # tmp: no second rename
        return
    state = {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).cpu()
             for k, v in network.state_dict().items()}
    with atomic_path(path) as tmp:
        torch.save(_renamed(state, name_map or {}), tmp)


def _text_encoder_adapters(network, components: Components) -> list[tuple[torch.nn.Module, int]]:
    """(adapter module, index of the text encoder it wraps) for every text-encoder adapter of the network."""
    owner = {id(m): i for i, encoder in enumerate(components.text_encoders) for m in encoder.modules()}
    found = []
    for lora in getattr(network, "text_encoder_loras", []):
        org = getattr(lora, "org_module", None)
        org = org[0] if isinstance(org, (list, tuple)) else org  # LyCORIS keeps it in a list
        if id(org) in owner:
            found.append((lora, owner[id(org)]))
    return found


def trained_text_encoders(network, components: Components) -> frozenset[int]:
    """Indices of the text encoders the network has adapter modules on (ours or an external module's)."""
    return frozenset(enc for _, enc in _text_encoder_adapters(network, components))
