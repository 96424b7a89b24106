"""Z-Image's own networks.lora `--network_args`.

As musubi-tuner's networks/lora_zimage.py, a LoRA goes on the Linears of the main `layers` blocks only: the names
holding `_modulation` (the AdaLN projections) and `_refiner` (the noise and context refiner blocks) are left out.
`train_refiners=True` and `train_modulation=True` put them back (ComfyUI loads them too: they are original module
paths). `verbose=True` logs every module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from networks.lora_rules import parse_bool

KEYS = ("train_refiners", "train_modulation", "verbose")
UNET = "lora_unet_"


@dataclass
class ZImageModuleRules:
    """The parsed Z-Image arguments (networks/lora_rules.py ModuleRules)."""

    train_refiners: bool = False
    train_modulation: bool = False
    verbose: bool = False

    def enables(self, key: str) -> bool:
        return False

    def split(self, name: str) -> bool:
        return False

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        if not name.startswith(UNET):
            return default
        if "_refiner" in name and not self.train_refiners:
            return 0
        if "_modulation" in name and not self.train_modulation:
            return 0
        return default

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        return None


@dataclass(frozen=True)
class ZImageNetworkArgs:
    """Z-Image's networks.lora arguments."""

    keys: tuple[str, ...] = KEYS

    def parse(self, raw: Mapping[str, str]) -> ZImageModuleRules:
        return ZImageModuleRules(train_refiners=parse_bool("train_refiners", raw.get("train_refiners")),
                                 train_modulation=parse_bool("train_modulation", raw.get("train_modulation")),
                                 verbose=parse_bool("verbose", raw.get("verbose")))
