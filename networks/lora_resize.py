"""Resize a LoRA to a lower rank, fixed or chosen per module by a dynamic method.

Per module: SVD of up @ down (by the fast factor SVD), pick rank k by
`lora_svd.choose_rank`, then up = U_k·diag(S_k), down = V_kᵀ and alpha = scale·k,
so ΔW of the kept directions is unchanged (sd-scripts' resize, inventory §11).
A resize never raises a module's rank: ranks above the old one would only hold
zero singular values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch

from library.core.errors import ConfigError
from networks import lora_svd
from networks.lora_files import LoraModule
from networks.lora_svd import SVD, RankRule


@dataclass
class ResizeOptions:
    """The resize flags: --new_rank, --new_conv_rank, --dynamic_method, --dynamic_param, --device."""

    new_rank: int = 4
    new_conv_rank: Optional[int] = None  # default: new_rank
    dynamic_method: Optional[str] = None
    dynamic_param: Optional[Union[float, str]] = None
    device: str = "cpu"
    svd: str = "fast"  # "full": the dense reference SVD (benchmarks, tests)

    def rules(self) -> tuple[RankRule, RankRule]:
        """(rule for linear / 1x1 modules, rule for k×k conv modules), validated."""
        if self.new_rank < 1:
            raise ConfigError(f"--new_rank: expected an integer >= 1, got {self.new_rank}")
        conv_rank = self.new_conv_rank if self.new_conv_rank is not None else self.new_rank
        if conv_rank < 1:
            raise ConfigError(f"--new_conv_rank: expected an integer >= 1, got {conv_rank}")
        method, param, recipe = self.dynamic_method, None, None
        if method is not None:
            if method not in lora_svd.DYNAMIC_METHODS:
                raise ConfigError(f"--dynamic_method: expected one of {', '.join(lora_svd.DYNAMIC_METHODS)}, "
                                  f"got {method!r}")
            if self.dynamic_param is None:
                raise ConfigError(f"--dynamic_param: required with --dynamic_method {method}")
            if method == "recipe":
                recipe = lora_svd.parse_recipe(str(self.dynamic_param))
            else:
                param = _positive_float(self.dynamic_param, method)
        return (RankRule(self.new_rank, method, param, recipe), RankRule(conv_rank, method, param, recipe))


def _positive_float(value: Union[float, str], method: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--dynamic_param: expected a number for {method}, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"--dynamic_param: expected a number > 0 for {method}, got {value!r}")
    return number


@dataclass(frozen=True)
class ModuleReport:
    """What happened to one module (printed with --verbose)."""

    name: str
    old_rank: int
    new_rank: int  # 0: dropped (a recipe kept no singular value)
    sum_retained: float
    fro_retained: float
    max_ratio: float

    def line(self) -> str:
        return (f"{self.name}: rank {self.old_rank} -> {self.new_rank}, sum(S) retained: {self.sum_retained:.1%}, "
                f"fro retained: {self.fro_retained:.1%}, max(S) ratio: {self.max_ratio:0.1f}")


@dataclass
class ResizeResult:
    modules: list[LoraModule] = field(default_factory=list)
    reports: list[ModuleReport] = field(default_factory=list)


def module_svd(module: LoraModule, method: str = "fast", device: str = "cpu") -> SVD:
    """SVD of the module's up @ down (scale not included), flattened to [out, in·k²]."""
    up, down = module.factors(device)
    if method == "full":
        return lora_svd.full_svd(up @ down)
    return lora_svd.factor_svd(up, down)


def resize_module(module: LoraModule, rule: RankRule, method: str = "fast", device: str = "cpu",
                  base_weight: Optional[torch.Tensor] = None) -> tuple[Optional[LoraModule], ModuleReport]:
    """One module at its new rank (None when a recipe keeps nothing) and its report."""
    svd = module_svd(module, method, device)
    scale = module.scale
    if rule.recipe is not None:
        rank = min(lora_svd.recipe_rank(svd.S * scale, rule.recipe, base_weight), rule.max_rank)
    else:
        rank = lora_svd.choose_rank(svd.S, rule, full_len=min(module.out_features, module.in_flat))
    rank = min(rank, module.rank, svd.S.numel())
    fractions = lora_svd.retained_fractions(svd.S, rank) if rank else (0.0, 0.0, float("inf"))
    report = ModuleReport(module.name, module.rank, rank, *fractions)
    if rank == 0:
        return None, report
    kept = svd.truncate(rank)
    up = (kept.U * kept.S).cpu()
    down = kept.Vh.cpu()
    # alpha = scale·k keeps ΔW = up @ down · alpha / k equal to the original.
    return module.with_factors(up, down, scale * rank), report


def resize_modules(modules: Mapping[str, LoraModule], opts: ResizeOptions,
                   base_weights: Optional[Mapping[str, torch.Tensor]] = None,
                   progress: Optional[Callable[[int, int], None]] = None) -> ResizeResult:
    """Resize every module; `base_weights` (by LoRA name) are needed by recipes using *_ckpt."""
    linear_rule, conv_rule = opts.rules()
    recipe = linear_rule.recipe
    if recipe is not None and recipe.needs_base and base_weights is None:
        raise ConfigError("--dynamic_method recipe with spn_ckpt/fro_ckpt needs --base_model")
    result = ResizeResult()
    for i, (name, module) in enumerate(modules.items()):
        base = None
        if recipe is not None and recipe.needs_base:
            if name not in base_weights:
                raise ConfigError(f"--base_model: has no weight for LoRA module {name}")
            base = base_weights[name]
        rule = conv_rule if module.is_conv else linear_rule
        new, report = resize_module(module, rule, opts.svd, opts.device, base)
        if new is not None:
            new = LoraModule(new.name, new.down.to(module.down.dtype), new.up.to(module.up.dtype), new.alpha)
            result.modules.append(new)
        result.reports.append(report)
        if progress is not None:
            progress(i + 1, len(modules))
    return result


def resize_comment(opts: ResizeOptions, old_dim: str) -> str:
    """The ss_training_comment prefix sd-scripts writes for a resize."""
    if opts.dynamic_method:
        return f"dynamic resize with {opts.dynamic_method}: {opts.dynamic_param} from {old_dim}"
    return f"Dimension resized from {old_dim} to {opts.new_rank}"
