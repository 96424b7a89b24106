"""Which modules of a model get a LoRA, and the kohya names they are saved under."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn


@dataclass
class LoraTarget:
    """One model part that receives LoRA modules.

    Every nn.Linear / nn.Conv2d inside a submodule whose class name is in
    `target_classes` gets a LoRA; `conv_target_classes` are added when conv_dim is
    set. The kohya module name is `prefix + "_" + rename(path).replace(".", "_")`
    where `path` is the dotted module path inside `root`.
    """

    prefix: str  # "lora_unet", "lora_te", "lora_te1", ...
    root: nn.Module
    target_classes: tuple[str, ...]
    conv_target_classes: tuple[str, ...] = ()
    is_text_encoder: bool = False
    rename: Optional[Callable[[str], str]] = None  # diffusers path -> kohya path (SDXL: SGM names)
    # Fused kohya modules (Flux `img_attn_qkv`, `linear1`): diffusers path -> the position of its
    # output slice in the fused module named by `rename`, or None for an ordinary module. Modules
    # that share a kohya name become one LoRA with a shared lora_down and one lora_up slice each.
    fused_slot: Optional[Callable[[str], Optional[int]]] = None
    # The prefix that modules of an external network (lycoris.kohya), which keep raw module paths under a
    # fused target, get in saved files instead of `prefix` (Flux: "lycoris", which ComfyUI maps from
    # diffusers paths onto its fused BFL weights). None: `prefix`.
    external_prefix: Optional[str] = None
    # An optional target: the --network_args key that turns it on (Flux: T5 by train_t5xxl, the layers outside
    # the blocks by in_dims). A network built from a file (--dim_from_weights, generation, merging) takes every
    # module the file has, whatever this says. None: always on.
    enabled_by: Optional[str] = None
    # The family's own networks.lora --network_args (networks/lora_rules.py NetworkArgRules: the keys it reads and
    # the per-module dims / learning rates they give); the same object on each of the family's targets.
    network_args: Optional[Any] = None



# `enabled_by` of the targets that only a file turns on: networks.lora never trains them (sd-scripts' lora.py
# has no argument for them), but a file that names them (LyCORIS `preset=full`: a UNet's conv_in, time and
# label embeddings, conv_out) loads, merges and resizes onto them instead of dropping them.
FROM_FILE_ONLY = "a file that has them"


def outside_block_targets(unet: nn.Module, prefix: str, rename: Optional[Callable[[str], str]] = None,
                          network_args: Optional[Any] = None) -> list[LoraTarget]:
    """Optional targets (FROM_FILE_ONLY) for a diffusers UNet's layers outside its blocks: `conv_in`,
    `conv_out` and the Linears of every TimestepEmbedding (`time_embedding`, SDXL's `add_embedding`).

    `rename`: the family's diffusers path -> kohya path (SDXL: SGM, `conv_in` -> `input_blocks.0.0`).
    """
    targets = []
    for path in ("conv_in", "conv_out"):
        layer = getattr(unet, path, None)
        if isinstance(layer, nn.Conv2d):
            targets.append(LoraTarget(prefix, layer, ("Conv2d",),
                                      rename=lambda _p, path=path: rename(path) if rename is not None else path,
                                      enabled_by=FROM_FILE_ONLY, network_args=network_args))
    targets.append(LoraTarget(prefix, unet, ("TimestepEmbedding",), rename=rename, enabled_by=FROM_FILE_ONLY,
                              network_args=network_args))
    return targets


# Targets used when the caller passes no `lora_targets` (an sd-scripts style caller).
SD_UNET_TARGETS = ("Transformer2DModel",)
SD_UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
CLIP_TARGETS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")


def clip_text_model_rename(text_encoder: nn.Module) -> Optional[Callable[[str], str]]:
    """Rename for a CLIP text encoder whose paths lack the `text_model.` level.

    kohya names (and diffusers' converter) expect `text_model.encoder.layers...`;
    transformers 5 builds CLIPTextModel without the `text_model` wrapper, so the
    level is put back in the name. None when the model already has it.
    """
    if hasattr(text_encoder, "text_model") or not hasattr(text_encoder, "encoder"):
        return None
    return lambda path: "text_model." + path


def default_lora_targets(text_encoder: Any, unet: Optional[nn.Module]) -> list[LoraTarget]:
    """SD-style targets for callers that pass none: lora_unet plus lora_te (or lora_te1/lora_te2)."""
    encoders = _as_list(text_encoder)
    targets = []
    if unet is not None:
        targets.append(LoraTarget("lora_unet", unet, SD_UNET_TARGETS, SD_UNET_CONV_TARGETS))
    for i, te in enumerate(encoders):
        prefix = "lora_te" if len(encoders) == 1 else f"lora_te{i + 1}"
        targets.append(LoraTarget(prefix, te, CLIP_TARGETS, is_text_encoder=True, rename=clip_text_model_rename(te)))
    return targets


def _as_list(modules: Any) -> list[nn.Module]:
    if modules is None:
        return []
    return [m for m in modules if m is not None] if isinstance(modules, (list, tuple)) else [modules]


def iter_target_paths(target: LoraTarget, include_conv: bool) -> Iterable[tuple[str, nn.Module]]:
    """(module path inside target.root, Linear/Conv2d) for every module of `target` that can get a LoRA."""
    classes = set(target.target_classes) | (set(target.conv_target_classes) if include_conv else set())
    seen: set[int] = set()
    for path, module in target.root.named_modules():
        if type(module).__name__ not in classes:
            continue
        for child_path, child in module.named_modules():
            if not isinstance(child, (nn.Linear, nn.Conv2d)) or id(child) in seen:
                continue
            seen.add(id(child))
            yield ".".join(p for p in (path, child_path) if p), child


def kohya_module_name(target: LoraTarget, path: str) -> str:
    """The kohya name of the module at `path` in `target.root`: prefix + renamed path, "." -> "_"."""
    full = target.rename(path) if target.rename is not None else path
    return f"{target.prefix}_{full.replace('.', '_')}"


def iter_target_modules(target: LoraTarget, include_conv: bool) -> Iterable[tuple[str, nn.Module]]:
    """(kohya module name, Linear/Conv2d) for every module of `target` that can get a LoRA.

    Members of a fused group (target.fused_slot) share one name and come once each.
    """
    for path, child in iter_target_paths(target, include_conv):
        yield kohya_module_name(target, path), child


def iter_target_groups(target: LoraTarget, include_conv: bool) -> Iterable[tuple[str, list[nn.Module]]]:
    """(kohya module name, modules) in model order: one module each, or the members of a fused
    group ordered by their slot in the fused kohya layer."""
    groups: dict[str, list[tuple[int, nn.Module]]] = {}
    for path, child in iter_target_paths(target, include_conv):
        slot = target.fused_slot(path) if target.fused_slot is not None else None
        groups.setdefault(kohya_module_name(target, path), []).append((0 if slot is None else slot, child))
    for name, members in groups.items():
        yield name, [m for _, m in sorted(members, key=lambda item: item[0])]


def is_linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or tuple(module.kernel_size) == (1, 1)


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

