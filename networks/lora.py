"""The sd-scripts compatible LoRA network (`--network_module networks.lora`).

`create_network` / `create_network_from_weights` and the methods of `LoRANetwork`
are the interface the training loop and external tools call, with the same names
and arguments as sd-scripts' networks/lora.py. Which modules get a LoRA comes from
the model family's `LoraTarget`s; the weight math lives in networks/lora_math.py
and the `--network_args` parsing in networks/lora_args.py; a family's own arguments
(FLUX.1's per-type dims, in_dims, block selection, regex dims / learning rates,
train_t5xxl) come with its targets and are applied per module through
networks/lora_rules.py.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from library.core.errors import ConfigError, UserError
from networks import ggpo, lora_math
from networks.lora_args import (
    SD_BLOCK_LAYOUT,
    BlockLayout,
    LoraNetworkArgs,
    parse_network_args,
)
from networks.lora_fused import FusedLoRAModule
from networks.lora_module import LoRAModule
from networks.lora_rules import ModuleRules, rules_of
from networks.lora_targets import (  # noqa: F401 (re-exported)
    CLIP_TARGETS,
    SD_UNET_CONV_TARGETS,
    SD_UNET_TARGETS,
    LoraTarget,
    is_linear_like,
    clip_text_model_rename,
    default_lora_targets,
    iter_target_groups,
    iter_target_modules,
    iter_target_paths,
    kohya_module_name,
)
from networks.network_base import AdapterNetwork, load_state_dict  # noqa: F401 (sd-scripts' module API)

logger = logging.getLogger(__name__)


class LoRANetwork(AdapterNetwork):
    """All LoRA modules of one model, split into `text_encoder_loras` and `unet_loras`."""

    # sd-scripts' class constants, for external code that reads them
    NUM_OF_BLOCKS = 12
    UNET_TARGET_REPLACE_MODULE = list(SD_UNET_TARGETS)
    UNET_TARGET_REPLACE_MODULE_CONV2D_3X3 = list(SD_UNET_CONV_TARGETS)
    TEXT_ENCODER_TARGET_REPLACE_MODULE = list(CLIP_TARGETS)
    LORA_PREFIX_UNET = "lora_unet"
    LORA_PREFIX_TEXT_ENCODER = "lora_te"
    LORA_PREFIX_TEXT_ENCODER1 = "lora_te1"
    LORA_PREFIX_TEXT_ENCODER2 = "lora_te2"

    def __init__(self, targets: list[LoraTarget], multiplier: float = 1.0, args: Optional[LoraNetworkArgs] = None,
                 dropout: Optional[float] = None, modules_dim: Optional[dict[str, int]] = None,
                 modules_alpha: Optional[dict[str, Any]] = None, block_layout: BlockLayout = SD_BLOCK_LAYOUT,
                 rules: Optional[ModuleRules] = None):
        super().__init__()
        self.args = args or LoraNetworkArgs()
        self.multiplier = multiplier
        self.block_layout = block_layout
        self.rules = rules  # the family's own network args (networks/lora_rules.py), if it has any
        self.text_encoder_loras: list[LoRAModule] = []
        self.unet_loras: list[LoRAModule] = []
        a = self.args
        include_conv = modules_dim is not None or a.conv_dim is not None or a.conv_block_dims is not None
        # A file decides its own modules; otherwise an optional target needs the argument that turns it on.
        targets = [t for t in targets if modules_dim is not None or t.enabled_by is None
                   or (rules is not None and rules.enables(t.enabled_by))]
        # text-encoder targets the user turned on by a network arg (Flux: train_t5xxl), for apply_to's warning
        self._te_enabled_by = {t.enabled_by for t in targets if t.is_text_encoder and t.enabled_by
                               and modules_dim is None}
        for target in targets:
            for name, modules in iter_target_groups(target, include_conv):
                dim, alpha = self._dim_alpha(name, modules[0], target.is_text_encoder, modules_dim, modules_alpha)
                if not dim:
                    continue
                if len(modules) > 1:
                    # Several projections under one kohya name (Flux qkv): one shared lora_down, or with the family's
                    # split rule (sd-scripts' split_qkv) one rank-dim LoRA each, saved as one of rank n·dim.
                    split = modules_dim is None and self._splits(name)
                    if split:
                        dim, alpha = dim * len(modules), alpha * len(modules) if alpha else alpha
                    lora = FusedLoRAModule(name, modules, multiplier, dim, alpha, dropout, a.rank_dropout,
                                           a.module_dropout, split=split)
                else:
                    lora = LoRAModule(name, modules[0], multiplier, dim, alpha, dropout, a.rank_dropout,
                                      a.module_dropout)
                (self.text_encoder_loras if target.is_text_encoder else self.unet_loras).append(lora)
        # in the model's order: the i-th text encoder with modules takes the i-th --text_encoder_lr
        te_names = [lora.lora_name for lora in self.text_encoder_loras]
        self.text_encoder_prefixes = list(dict.fromkeys(
            t.prefix for t in targets if t.is_text_encoder and any(n.startswith(t.prefix + "_") for n in te_names)))
        names = [lora.lora_name for lora in self.text_encoder_loras + self.unet_loras]
        if len(set(names)) != len(names):
            raise ValueError("LoRA module names are not unique; check the family's LoraTarget prefixes")
        for lora in self.text_encoder_loras + self.unet_loras:
            self.add_module(lora.lora_name, lora)
        logger.info("LoRA modules: %d text encoder, %d unet", len(self.text_encoder_loras), len(self.unet_loras))
        ggpo_args = getattr(rules, "ggpo", None)  # (sigma, beta): the family's rules with ggpo_sigma / ggpo_beta
        self.ggpo = ggpo_args is not None  # also on a network shaped by a file (--dim_from_weights): train-only
        if modules_dim is not None and getattr(rules, "split_qkv", False):
            logger.warning("split_qkv: the modules come from a file (--dim_from_weights), which holds each fused "
                           "layer as one LoRA; they train as such, not split")
        if self.ggpo:
            count = ggpo.attach(self.text_encoder_loras + self.unet_loras, *ggpo_args)
            logger.info("LoRA-GGPO training sigma: %g beta: %g (%d modules)", *ggpo_args, count)
        if rules is not None and rules.verbose:
            for lora in self.text_encoder_loras + self.unet_loras:
                logger.info("  %-60s dim %d, alpha %g", lora.lora_name, lora.lora_dim, float(lora.alpha))

    def _splits(self, name: str) -> bool:
        """Whether the family's rules split the fused module `name` into one LoRA per projection (optional rule)."""
        split = getattr(self.rules, "split", None)
        return bool(split is not None and split(name))

    def _dim_alpha(self, name: str, module: nn.Module, is_te: bool, modules_dim: Optional[dict],
                   modules_alpha: Optional[dict]) -> tuple[Optional[int], Any]:
        a = self.args
        if modules_dim is not None:
            return (modules_dim[name], modules_alpha[name]) if name in modules_dim else (None, None)
        dim, alpha = self._generic_dim_alpha(name, module, is_te)
        if self.rules is None:
            return dim, alpha
        # the family's rules (per-type dims, regex dims, ...) set the dim; alpha stays the network's
        return self.rules.dim(name, dim), alpha if alpha is not None else a.network_alpha

    def _generic_dim_alpha(self, name: str, module: nn.Module, is_te: bool) -> tuple[Optional[int], Any]:
        """dim and alpha from the generic args: block_dims, conv_dim or network_dim."""
        a = self.args
        linear_like = is_linear_like(module)
        idx = -1 if is_te or a.block_dims is None else self.block_layout(name)
        if idx >= 0:
            if linear_like:
                return a.block_dims[idx], a.block_alphas[idx]
            if a.conv_block_dims is not None:
                return a.conv_block_dims[idx], a.conv_block_alphas[idx]
            return None, None
        if linear_like:
            return a.network_dim, a.network_alpha
        return a.conv_dim, a.conv_alpha

    # --- sd-scripts network interface -------------------------------------------
    def adapters(self) -> list[LoRAModule]:
        return self.text_encoder_loras + self.unet_loras

    def apply_to(self, text_encoder: Any = None, unet: Any = None, apply_text_encoder: bool = True,
                 apply_unet: bool = True) -> None:
        """Hook the LoRAs into the model; the parts not applied are dropped from the network."""
        if not apply_text_encoder and self.text_encoder_loras and self._te_enabled_by:
            logger.warning("--network_args %s: the text encoders do not train in this run, so it has no effect",
                           ", ".join(sorted(self._te_enabled_by)))
        for keep, loras in ((apply_text_encoder, self.text_encoder_loras), (apply_unet, self.unet_loras)):
            if not keep:
                for lora in loras:
                    delattr(self, lora.lora_name)
                loras.clear()
        super().apply_to()

    def is_mergeable(self) -> bool:
        return True

    @torch.no_grad()
    def merge_to(self, text_encoder: Any = None, unet: Any = None, weights_sd: Optional[dict] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[Union[str, torch.device]] = None) -> None:
        """Bake multiplier * ΔW into the base weights (from `weights_sd`, or this network's own)."""
        sd = weights_sd if weights_sd is not None else self.state_dict()
        for lora in self.text_encoder_loras + self.unet_loras:
            prefix = lora.lora_name + "."
            if prefix + "lora_down.weight" not in sd:
                continue
            if isinstance(lora, FusedLoRAModule):
                lora.merge_weights(sd[prefix + "lora_down.weight"], sd[prefix + "lora_up.weight"],
                                   sd.get(prefix + "alpha"), lora.multiplier, dtype, device)
                continue
            weight = lora.org_module.weight
            merged = lora_math.merge_into(weight.data, sd[prefix + "lora_down.weight"], sd[prefix + "lora_up.weight"],
                                          sd.get(prefix + "alpha"), lora.multiplier)
            weight.data = merged.to(device=device or weight.device, dtype=dtype or weight.dtype)

    def load_weights(self, file: Union[str, os.PathLike, Mapping[str, torch.Tensor]], source: Optional[str] = None) -> Any:
        """Load a LoRA file, or a state dict in this network's naming (missing / extra keys are allowed, as sd-scripts).

        `source` names the weights in error messages (default: the file's path).
        """
        if isinstance(file, (str, os.PathLike)):
            source = source or os.fspath(file)
            weights_sd = load_state_dict(os.fspath(file))
        else:
            weights_sd = dict(file)
        flag = f"--network_weights {source}" if source else "--network_weights"
        own = self.state_dict()
        for key, value in weights_sd.items():
            if key in own and own[key].shape != value.shape:
                raise UserError(f"{flag}: {key} has shape {list(value.shape)} in the file but "
                                f"{list(own[key].shape)} in the network; use --dim_from_weights or the file's dims")
        info = self.load_state_dict(weights_sd, strict=False)
        # Unlike sd-scripts, the loaded alpha also sets the scale, so training continues
        # with exactly the strength the file was saved with.
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.refresh_scale()
        return info

    def prepare_optimizer_params(self, text_encoder_lr: Any, unet_lr: Optional[float],
                                 default_lr: Optional[float]) -> tuple[list[dict], list[str]]:
        """Optimizer param groups and their names: "textencoder", "unet", "unet block 3", "... plus".

        `text_encoder_lr` is one rate for every text encoder or a list with one per
        text encoder in the model's order; then each encoder gets its own groups,
        named "textencoder 1", "textencoder 2", ...
        """
        self.requires_grad_(True)
        a = self.args
        groups: list[dict] = []
        descriptions: list[str] = []

        def add(loras: list[LoRAModule], lr: Optional[float], ratio: Optional[float], name: str) -> None:
            for group_name, members, members_lr in self._split_by_rule_lr(loras, lr, name):
                add_group(members, members_lr, ratio, group_name)

        def add_group(loras: list[LoRAModule], lr: Optional[float], ratio: Optional[float], name: str) -> None:
            plain = [p for lora in loras for n, p in lora.named_parameters() if ratio is None or "lora_up" not in n]
            plus = [p for lora in loras for n, p in lora.named_parameters() if ratio is not None and "lora_up" in n]
            for params, group_lr, suffix in ((plain, lr, ""), (plus, None if lr is None else lr * (ratio or 0), " plus")):
                if params and group_lr:  # a group at lr 0 (or no lr) never trains: leave it out
                    groups.append({"params": params, "lr": group_lr})
                    descriptions.append(name + suffix)

        if self.text_encoder_loras:
            ratio = a.loraplus_text_encoder_lr_ratio or a.loraplus_lr_ratio
            for name, loras, lr in self._text_encoder_groups(text_encoder_lr, default_lr):
                add(loras, lr, ratio, name)
        if self.unet_loras:
            lr = unet_lr if unet_lr is not None else default_lr
            ratio = a.loraplus_unet_lr_ratio or a.loraplus_lr_ratio
            if a.block_lr:
                by_block: dict[int, list[LoRAModule]] = {}
                for lora in self.unet_loras:
                    by_block.setdefault(self.block_layout(lora.lora_name), []).append(lora)
                for idx in sorted(by_block):
                    add(by_block[idx], None if lr is None else lr * a.lr_weight(idx), ratio, f"unet block {idx}")
            else:
                add(self.unet_loras, lr, ratio, "unet")
        return groups, descriptions

    def _split_by_rule_lr(self, loras: list[LoRAModule], lr: Optional[float],
                          name: str) -> list[tuple[str, list[LoRAModule], Optional[float]]]:
        """(name, modules, lr): one group per rate rule that matches (network_reg_lrs; "unet reg_lr_0", ...),
        in rule order, then the rest at `lr`. A rule's rate replaces the group's rate, as in sd-scripts."""
        if self.rules is None:
            return [(name, loras, lr)]
        by_rule: dict[int, tuple[float, list[LoRAModule]]] = {}
        rest = []
        for lora in loras:
            hit = self.rules.lr(lora.lora_name)
            if hit is None:
                rest.append(lora)
            else:
                by_rule.setdefault(hit[0], (hit[1], []))[1].append(lora)
        return [(f"{name} reg_lr_{i}", members, rule_lr) for i, (rule_lr, members) in sorted(by_rule.items())] \
            + [(name, rest, lr)]

    def _text_encoder_groups(self, text_encoder_lr: Any,
                             default_lr: Optional[float]) -> list[tuple[str, list[LoRAModule], Optional[float]]]:
        """(name, modules, lr) per text-encoder group: one "textencoder" group unless one rate per encoder is given."""
        rates = list(text_encoder_lr) if isinstance(text_encoder_lr, (list, tuple)) else [text_encoder_lr]
        rates = [default_lr if r is None else r for r in rates] or [default_lr]
        n = max(len(self.text_encoder_prefixes), 1)
        if len(rates) > n:
            # sd-scripts' lora.py silently takes the first rate; say what is dropped
            logger.warning("--text_encoder_lr: %d values for %d text encoder(s); ignoring %s", len(rates), n,
                           rates[n:])
            rates = rates[:n]
        if len(rates) == 1:
            return [("textencoder", self.text_encoder_loras, rates[0])]
        if len(rates) != n:
            raise ConfigError(f"--text_encoder_lr: expected 1 or {n} values for this model (one per text encoder), "
                              f"got {len(rates)}")
        return [(f"textencoder {i + 1}", [m for m in self.text_encoder_loras if m.lora_name.startswith(prefix + "_")],
                 lr) for i, (prefix, lr) in enumerate(zip(self.text_encoder_prefixes, rates))]

    def update_grad_norms(self) -> None:
        """LoRA-GGPO: each module's ΔW gradient row norms (after clipping, before the optimizer step)."""
        for lora in self._ggpo_loras():
            lora.ggpo.update_grad_norms(lora)

    def update_norms(self) -> None:
        """LoRA-GGPO: each module's combined weight row norms (after update_grad_norms)."""
        for lora in self._ggpo_loras():
            lora.ggpo.update_norms(lora)

    def ggpo_logs(self) -> dict[str, float]:
        """Mean ΔW, gradient and combined row norms over the GGPO modules (sd-scripts' progress-bar values)."""
        states = [lora.ggpo for lora in self._ggpo_loras() if lora.ggpo.active()]
        if not states:
            return {}
        def mean(norms: list[torch.Tensor]) -> float:
            return float(torch.stack([n.mean() for n in norms]).mean())
        return {"ggpo/mean_weight_norm": mean([s.weight_norms for s in states]),
                "ggpo/mean_grad_norm": mean([s.grad_norms for s in states]),
                "ggpo/mean_combined_norm": mean([s.combined_weight_norms for s in states])}

    def _ggpo_loras(self) -> list[nn.Module]:
        if not self.ggpo or not self.training:
            return []
        return [lora for lora in self.text_encoder_loras + self.unet_loras if lora.ggpo is not None]

    @torch.no_grad()
    def apply_max_norm_regularization(self, max_norm_value: float, device: Any) -> tuple[int, float, float]:
        """--scale_weight_norms: rescale each module whose ‖ΔW‖_F exceeds the limit.

        Returns (number of modules scaled, mean norm, max norm) after scaling.
        """
        norms = []
        keys_scaled = 0
        for lora in self.text_encoder_loras + self.unet_loras:
            down, up = lora.lora_down.weight, lora.lora_up.weight
            result = lora_math.frobenius_scale_for_max_norm(down.to(device), up.to(device), lora.alpha, max_norm_value)
            if result.scaled:
                keys_scaled += 1
                down.mul_(result.factor)
                up.mul_(result.factor)
            norms.append(result.norm)
        if not norms:
            return 0, 0.0, 0.0
        return keys_scaled, sum(norms) / len(norms), max(norms)


def _targets(lora_targets: Optional[list[LoraTarget]], text_encoder: Any, unet: Any) -> list[LoraTarget]:
    return list(lora_targets) if lora_targets is not None else default_lora_targets(text_encoder, unet)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae: Any,
                   text_encoder: Any, unet: Any, neuron_dropout: Optional[float] = None,
                   lora_targets: Optional[list[LoraTarget]] = None,
                   block_layout: BlockLayout = SD_BLOCK_LAYOUT, **kwargs: Any) -> LoRANetwork:
    """A new LoRA network; `kwargs` are the `--network_args` (string values), block values in `block_layout`.

    Arguments of the model family (declared on its targets, networks/lora_rules.py) are parsed by it.
    """
    targets = _targets(lora_targets, text_encoder, unet)
    args, rules = _parse_args(kwargs, network_dim, network_alpha, block_layout, targets)
    return LoRANetwork(targets, multiplier, args, dropout=neuron_dropout, block_layout=block_layout, rules=rules)


def _parse_args(kwargs: dict, network_dim: Optional[int], network_alpha: Optional[float], block_layout: BlockLayout,
                targets: list[LoraTarget]) -> tuple[LoraNetworkArgs, Optional[ModuleRules]]:
    """The generic args and, where the targets carry the family's own, its parsed rules."""
    family = rules_of(targets)
    keys = tuple(family.keys) if family is not None else ()
    args = parse_network_args(kwargs, network_dim, network_alpha, block_layout, family_keys=keys)
    rules = family.parse({k: v for k, v in kwargs.items() if k in keys}) if family is not None else None
    return args, rules


def create_network_from_weights(multiplier: float, file: Optional[str], vae: Any, text_encoder: Any, unet: Any,
                                weights_sd: Optional[dict] = None, for_inference: bool = False,
                                lora_targets: Optional[list[LoraTarget]] = None,
                                block_layout: BlockLayout = SD_BLOCK_LAYOUT, **kwargs: Any) -> tuple[LoRANetwork, dict]:
    """A network shaped like a saved file: its modules (conv included), dims and alphas."""
    if weights_sd is None:
        weights_sd = load_state_dict(file)
    modules_dim: dict[str, int] = {}
    modules_alpha: dict[str, Any] = {}
    for key, value in weights_sd.items():
        name, _, rest = key.partition(".")
        if rest == "alpha":
            modules_alpha[name] = value
        elif rest == "lora_down.weight":
            modules_dim[name] = value.shape[0]
    for name, dim in modules_dim.items():
        modules_alpha.setdefault(name, dim)  # files from before alpha existed: scale 1
    targets = _targets(lora_targets, text_encoder, unet)
    # the file sets every module and dim; the family's rules still give learning rates (network_reg_lrs)
    args, rules = _parse_args(kwargs, None, None, block_layout, targets)
    network = LoRANetwork(targets, multiplier, args, modules_dim=modules_dim, modules_alpha=modules_alpha,
                          block_layout=block_layout, rules=rules)
    unmatched = set(modules_dim) - {lora.lora_name for lora in network.text_encoder_loras + network.unet_loras}
    if unmatched:
        logger.warning("%d modules of %s match nothing in this model, e.g. %s", len(unmatched), file or "the weights",
                       sorted(unmatched)[0])
    if for_inference:
        network.eval()
    return network, weights_sd
