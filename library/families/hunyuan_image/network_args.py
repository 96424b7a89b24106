"""HunyuanImage's own networks.lora `--network_args` (those of sd-scripts' networks/lora_hunyuan_image.py).

- `network_reg_dims` / `network_reg_lrs` (`regex=value,...` on the kohya module name, first match wins);
- `verbose=True`.

`split_qkv=True` is refused with a one-line error (the fused qkv / linear1 train with one shared lora_down, the
layout the file holds); sd-scripts' network has no LoRA for the text encoders, and neither has this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from library.core.errors import ConfigError
from networks.lora_rules import RegexValues, parse_bool, parse_regex_values

UNSUPPORTED = {
    "split_qkv": "networks.lora trains the fused qkv / linear1 with one shared lora_down (the saved layout); "
                 "drop split_qkv",
}
KEYS = ("network_reg_dims", "network_reg_lrs", "verbose", *UNSUPPORTED)


@dataclass
class HunyuanImageModuleRules:
    """The parsed arguments (networks/lora_rules.py ModuleRules)."""

    reg_dims: RegexValues = field(default_factory=RegexValues)
    reg_lrs: RegexValues = field(default_factory=RegexValues)
    verbose: bool = False

    def enables(self, key: str) -> bool:
        return False

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        hit = self.reg_dims.first_match(name)
        return hit[1] if hit is not None else default

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        return self.reg_lrs.first_match(name)


@dataclass(frozen=True)
class HunyuanImageNetworkArgs:
    """HunyuanImage's networks.lora arguments."""

    keys: tuple[str, ...] = KEYS

    def parse(self, raw: Mapping[str, str]) -> HunyuanImageModuleRules:
        for key, why in UNSUPPORTED.items():
            if raw.get(key) is not None and parse_bool(key, raw[key]):
                raise ConfigError(f"--network_args {key}: not supported: {why}")
        rules = HunyuanImageModuleRules()
        if raw.get("network_reg_dims") is not None:
            rules.reg_dims = parse_regex_values("network_reg_dims", raw["network_reg_dims"], int, "an integer >= 0")
        if raw.get("network_reg_lrs") is not None:
            rules.reg_lrs = parse_regex_values("network_reg_lrs", raw["network_reg_lrs"], float, "a number >= 0")
        rules.verbose = parse_bool("verbose", raw.get("verbose"))
        return rules
