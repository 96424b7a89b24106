"""LoRA / LyCORIS files applied to a loaded model for generation (tools/generate.py, bench): merged or hooked in."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from library.core.errors import ConfigError
from library.families.base import Components, ModelFamily
from library.train.adapters.network_kinds import network_kind

logger = logging.getLogger(__name__)


@dataclass
class NetworkSpec:
    """One LoRA/LyCORIS file to apply at generation: --network_module, --network_weights, --network_mul."""
    module: str
    weights: str
    multiplier: float = 1.0


@dataclass
class AppliedNetworks:
    """Networks hooked into a model (not merged); `remove()` unhooks them."""
    networks: list = field(default_factory=list)

    def remove(self) -> None:
        for network in self.networks:
            network.restore()
        self.networks.clear()


def network_specs(modules: Sequence[str], weights: Sequence[str], multipliers: Sequence[float]) -> list[NetworkSpec]:
    """Pair the per-network flags as sd-scripts' gen_img.py does (one module may serve every file)."""
    if not weights:
        if multipliers:
            raise ConfigError("--network_mul: given without --network_weights")
        return []
    modules = list(modules) or ["networks.lora"]
    if len(modules) == 1:
        modules = modules * len(weights)
    if len(modules) != len(weights):
        raise ConfigError(f"--network_module: expected 1 or {len(weights)} values (one per --network_weights), "
                          f"got {len(modules)}")
    if len(multipliers) > len(weights):
        raise ConfigError(f"--network_mul: expected at most {len(weights)} values (one per --network_weights), "
                          f"got {len(multipliers)}")
    muls = list(multipliers) + [1.0] * (len(weights) - len(multipliers))
    return [NetworkSpec(m, w, float(x)) for m, w, x in zip(modules, weights, muls)]


def _check_every_module_applies(spec: NetworkSpec, network, weights_sd: dict) -> None:
    """Stop with one line naming the file's modules that fit no layer of the model (they used to be dropped)."""
    built = {lora.lora_name for lora in getattr(network, "text_encoder_loras", []) + getattr(network, "unet_loras", [])}
    if not built:
        return  # a network module without sd-scripts' module lists: nothing to compare
    names = sorted({key.partition(".")[0] for key in weights_sd if "." in key})
    unmatched = [n for n in names if n not in built]
    if unmatched:
        shown = ", ".join(unmatched[:6]) + (f", ... ({len(unmatched)} in all)" if len(unmatched) > 6 else "")
        raise ConfigError(f"--network_weights {spec.weights}: {len(unmatched)} of its {len(names)} modules match no "
                          f"layer of this model with --network_module {spec.module}: {shown}")


def apply_networks(family: ModelFamily, components: Components, specs: Sequence[NetworkSpec], merge: bool,
                   device: torch.device, dtype: torch.dtype) -> AppliedNetworks:
    """Load each network file and merge it into the weights (`merge`) or hook it in at its multiplier."""
    applied = AppliedNetworks()
    te = components.text_encoders if len(components.text_encoders) > 1 else components.text_encoders[0]
    for spec in specs:
        if not os.path.isfile(spec.weights):
            raise ConfigError(f"--network_weights {spec.weights}: file not found")
        kind = network_kind(spec.module)
        network, weights_sd = kind.create_from_file(family, components, spec.weights, spec.multiplier,
                                                    for_inference=True)
        _check_every_module_applies(spec, network, weights_sd)
        if merge:
            if hasattr(network, "is_mergeable") and not network.is_mergeable():
                raise ConfigError(f"--merge: {spec.weights} ({spec.module}) cannot be merged; drop --merge")
            network.merge_to(te, components.denoiser, weights_sd, dtype, device)
            logger.info("merged %s at multiplier %s", spec.weights, spec.multiplier)
            continue
        network.apply_to(te, components.denoiser, True, True)
        info = network.load_state_dict(weights_sd, strict=False)
        for lora in getattr(network, "text_encoder_loras", []) + getattr(network, "unet_loras", []):
            if hasattr(lora, "refresh_scale"):  # ours: the scale follows the loaded alpha
                lora.refresh_scale()
        network.to(device, dtype).eval()
        network.set_multiplier(spec.multiplier)
        applied.networks.append(network)
        logger.info("applied %s at multiplier %s (%s)", spec.weights, spec.multiplier, info)
    return applied

