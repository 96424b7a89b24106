"""Merging LoRAs: into a base model's weights, or into one new LoRA (exact concat or SVD re-factor).

LoRA + LoRA with ratios r_i gives ΔW = Σ r_i·ΔW_i. `concat_merge` stores it
exactly by stacking the ranks (the scales are baked into `up`, alpha = new rank);
`svd_merge` re-factors it to `new_rank` with the same fast factor SVD the resize
uses (the stacked factors are a rank-Σr product), never a dense SVD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from library.core.errors import ConfigError, UserError
from networks import lora_math, lora_svd
from networks.lora_files import LoraModule
from networks.lora_targets import LoraLayer


@dataclass(frozen=True)
class WeightedLora:
    """One input of a merge: its modules, its ratio and where it came from (for messages).

    `block_weights` (module name -> weight, from --lbws) multiplies into the ratio per
    module; a module missing from it has weight 1, one with weight 0 is left out.
    """

    modules: Mapping[str, LoraModule]
    ratio: float
    source: str = "LoRA"
    block_weights: Optional[Mapping[str, float]] = None

    def ratio_of(self, name: str) -> float:
        """The multiplier of module `name`'s ΔW: the ratio times its block weight."""
        return self.ratio * (self.block_weights.get(name, 1.0) if self.block_weights else 1.0)


def check_ratios(models: Sequence[str], ratios: Optional[Sequence[float]]) -> list[float]:
    """--ratios: one per --models entry; missing means 1.0 for every model."""
    if not ratios:
        return [1.0] * len(models)
    if len(ratios) != len(models):
        raise ConfigError(f"--ratios: expected {len(models)} values (one per --models file), got {len(ratios)}")
    return [float(r) for r in ratios]


def merge_into_layers(layers: Mapping[str, LoraLayer], loras: Sequence[WeightedLora]) -> int:
    """Add ratio·ΔW of every module into the matching base layer, in place; returns modules merged.

    A module may also be a LyCORIS one (networks.lycoris_delta.LycorisModule), merged as LyCORIS merges it.

    Refuses a LoRA with a module the model does not have, or one whose shape does
    not fit, before any weight is changed.
    """
    for lora in loras:
        for name, module in lora.modules.items():
            if name not in layers:
                raise UserError(f"{lora.source}: module {name} matches no layer of the base model "
                                f"(a LoRA for another model family or version?)")
            weight = layers[name].weight
            if not isinstance(module, LoraModule):  # a LyCORIS module: ΔW by LyCORIS, its shape checked there
                if module.numel() not in (None, weight.numel()):
                    raise UserError(f"{lora.source}: {name}: ΔW has {module.numel()} values "
                                    f"({list(module.file_shape())}) but the base weight is {list(weight.shape)}")
                continue
            if weight.numel() != module.out_features * module.in_flat:
                raise UserError(f"{lora.source}: {name}: ΔW has {module.out_features}x{module.in_flat} values but the "
                                f"base weight is {list(weight.shape)}")
    merged = 0
    with torch.no_grad():
        for lora in loras:
            for name, module in lora.modules.items():
                layer = layers[name]
                if isinstance(module, LoraModule):
                    new = lora_math.merge_into(layer.weight.data, module.down, module.up, module.alpha, lora.ratio)
                else:
                    new = module.merged_weight(layer.weight.data, lora.ratio)
                layer.set_weight(new)
                merged += 1
    return merged


def _modules_by_name(loras: Sequence[WeightedLora]) -> dict[str, list[tuple[LoraModule, float]]]:
    grouped: dict[str, list[tuple[LoraModule, float]]] = {}
    for lora in loras:
        for name, module in lora.modules.items():
            if lora.block_weights and lora.block_weights.get(name, 1.0) == 0:
                continue  # a block weighted 0 is left out, not merged as zeros
            grouped.setdefault(name, []).append((module, lora.ratio_of(name)))
    for name, parts in grouped.items():
        first = parts[0][0]
        for module, _ in parts[1:]:
            if (module.out_features, module.in_flat) != (first.out_features, first.in_flat):
                raise UserError(f"{name}: the LoRAs disagree on its shape ({first.out_features}x{first.in_flat} vs "
                                f"{module.out_features}x{module.in_flat}); were they trained on the same model?")
    return grouped


def stacked_factors(parts: Sequence[tuple[LoraModule, float]],
                    device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(up [out, Σr], down [Σr, in·k²]) in float32 with ratio·scale baked into up: up @ down = Σ ratio·ΔW."""
    ups, downs = [], []
    for module, ratio in parts:
        up, down = module.factors(device)
        ups.append(up * (ratio * module.scale))
        downs.append(down)
    return torch.cat(ups, dim=1), torch.cat(downs, dim=0)


def concat_merge(loras: Sequence[WeightedLora]) -> list[LoraModule]:
    """Exact merge: each module's rank is the sum of the inputs' ranks, alpha = that rank (scale 1)."""
    out = []
    for name, parts in _modules_by_name(loras).items():
        up, down = stacked_factors(parts)
        first = parts[0][0]
        merged = first.with_factors(up, down, float(down.shape[0]))
        out.append(LoraModule(name, merged.down.to(first.down.dtype), merged.up.to(first.up.dtype), merged.alpha))
    return out


def svd_merge(loras: Sequence[WeightedLora], new_rank: int, new_conv_rank: Optional[int] = None,
              device: str = "cpu") -> list[LoraModule]:
    """Σ ratio·ΔW re-factored to `new_rank` (k×k convs: `new_conv_rank`) by the factor SVD; alpha = rank."""
    if new_rank < 1:
        raise ConfigError(f"--new_rank: expected an integer >= 1, got {new_rank}")
    conv_rank = new_conv_rank or new_rank
    out = []
    for name, parts in _modules_by_name(loras).items():
        up, down = stacked_factors(parts, device)
        first = parts[0][0]
        rank = min(conv_rank if first.is_conv else new_rank, first.out_features, first.in_flat)
        svd = lora_svd.factor_svd(up, down).truncate(rank)
        if svd.S.numel() < rank:  # fewer directions than asked: pad with zeros so every module has the rank
            pad = rank - svd.S.numel()
            svd = lora_svd.SVD(torch.cat([svd.U, svd.U.new_zeros(svd.U.shape[0], pad)], 1),
                               torch.cat([svd.S, svd.S.new_zeros(pad)]),
                               torch.cat([svd.Vh, svd.Vh.new_zeros(pad, svd.Vh.shape[1])], 0))
        merged = first.with_factors((svd.U * svd.S).cpu(), svd.Vh.cpu(), float(rank))
        out.append(LoraModule(name, merged.down.to(first.down.dtype), merged.up.to(first.up.dtype), merged.alpha))
    return out
