"""Qwen-Image's own networks.lora `--network_args` (those of musubi-tuner's networks/lora_qwen_image.py).

- `exclude_mod` (default True, as musubi-tuner): no LoRA on the blocks' `img_mod` / `txt_mod` modulation Linears;
  `exclude_mod=False` trains them too;
- `network_reg_dims` / `network_reg_lrs` (`regex=value,...` on the kohya module name, first match wins; a dim of 0
  leaves a module out);
- `verbose=True`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from networks.lora_rules import RegexValues, parse_bool, parse_regex_values

KEYS = ("exclude_mod", "network_reg_dims", "network_reg_lrs", "verbose")
_MOD = re.compile(r"_(img|txt)_mod_")


@dataclass
class QwenImageModuleRules:
    """The parsed arguments (networks/lora_rules.py ModuleRules)."""

    exclude_mod: bool = True
    reg_dims: RegexValues = field(default_factory=RegexValues)
    reg_lrs: RegexValues = field(default_factory=RegexValues)
    verbose: bool = False

    def enables(self, key: str) -> bool:
        return False

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        hit = self.reg_dims.first_match(name)
        if hit is not None:
            return hit[1]
        return 0 if self.exclude_mod and _MOD.search(name) else default

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        return self.reg_lrs.first_match(name)


@dataclass(frozen=True)
class QwenImageNetworkArgs:
    """Qwen-Image's networks.lora arguments."""

    keys: tuple[str, ...] = KEYS

    def parse(self, raw: Mapping[str, str]) -> QwenImageModuleRules:
        rules = QwenImageModuleRules()
        if raw.get("exclude_mod") is not None:
            rules.exclude_mod = parse_bool("exclude_mod", raw["exclude_mod"])
        if raw.get("network_reg_dims") is not None:
            rules.reg_dims = parse_regex_values("network_reg_dims", raw["network_reg_dims"], int, "an integer >= 0")
        if raw.get("network_reg_lrs") is not None:
            rules.reg_lrs = parse_regex_values("network_reg_lrs", raw["network_reg_lrs"], float, "a number >= 0")
        rules.verbose = parse_bool("verbose", raw.get("verbose"))
        return rules
