"""Lumina's own networks.lora `--network_args` (those of sd-scripts' networks/lora_lumina.py).

- per-type dims `attn_dim`, `mlp_dim`, `mod_dim`, `refiner_dim` (0: no module) for the DiT's modules; as
  sd-scripts, the first type whose word is in the module name wins, in that order (`attention`, `mlp`,
  `modulation`, `refiner`: so a refiner block's attention takes `attn_dim` when it is given; `mlp` names no
  NextDiT module, whose MLP is `feed_forward`, so `mlp_dim` changes nothing, exactly as in sd-scripts);
- `train_blocks`: all (default), transformer (`layers_` only), noise_refiner, context_refiner, or refiners (both);
  DiT modules outside the choice get none (the final layer only with all);
- `verbose=True`.

`embedder_dims` (LoRAs on x / t / caption embedders) and `split_qkv=True` are refused with a one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from library.core.errors import ConfigError
from networks.lora_rules import parse_bool, parse_number

TYPE_DIMS = (("attn_dim", "attention"), ("mlp_dim", "mlp"), ("mod_dim", "modulation"), ("refiner_dim", "refiner"))
TRAIN_BLOCKS = {"all": None, "transformer": ("layers_",), "noise_refiner": ("noise_refiner",),
                "context_refiner": ("context_refiner",), "refiners": ("noise_refiner", "context_refiner")}
UNSUPPORTED = {
    "split_qkv": "networks.lora trains the fused qkv with one shared lora_down (the saved layout); drop split_qkv",
    "embedder_dims": "LoRAs on the x / t / caption embedders are not implemented for Lumina yet; drop embedder_dims",
}
KEYS = (*(k for k, _ in TYPE_DIMS), "train_blocks", "verbose", *UNSUPPORTED)
UNET = "lora_unet_"


@dataclass
class LuminaModuleRules:
    """The parsed Lumina arguments (networks/lora_rules.py ModuleRules)."""

    type_dims: dict[str, int] = field(default_factory=dict)
    filters: Optional[tuple[str, ...]] = None  # None: every DiT module
    verbose: bool = False

    def enables(self, key: str) -> bool:
        return False

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        if not name.startswith(UNET):
            return default
        dim = default
        for key, word in TYPE_DIMS:
            if key in self.type_dims and word in name:
                dim = self.type_dims[key]
                break
        if self.filters is not None and not any(f in name for f in self.filters):
            return 0
        return dim

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        return None


@dataclass(frozen=True)
class LuminaNetworkArgs:
    """Lumina's networks.lora arguments."""

    keys: tuple[str, ...] = KEYS

    def parse(self, raw: Mapping[str, str]) -> LuminaModuleRules:
        for key, why in UNSUPPORTED.items():
            if raw.get(key) is not None and (key != "split_qkv" or parse_bool(key, raw[key])):
                raise ConfigError(f"--network_args {key}: not supported: {why}")
        rules = LuminaModuleRules()
        for key, _ in TYPE_DIMS:
            if raw.get(key) is not None:
                rules.type_dims[key] = parse_number(key, raw[key], int, "an integer >= 0 (0: no module)")
        choice = raw.get("train_blocks")
        if choice is not None:
            if choice not in TRAIN_BLOCKS:
                raise ConfigError(f"--network_args train_blocks: expected one of {', '.join(TRAIN_BLOCKS)}, "
                                  f"got {choice!r}")
            rules.filters = TRAIN_BLOCKS[choice]
        rules.verbose = parse_bool("verbose", raw.get("verbose"))
        return rules
