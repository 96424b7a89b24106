"""Anima's own networks.lora `--network_args` (those of sd-scripts' networks/lora_anima.py).

- `train_llm_adapter=True`: LoRAs on the LLM adapter's blocks too (`lora_unet_llm_adapter_blocks_N_...`);
- `exclude_patterns` / `include_patterns`: Python lists of regexes (`"['.*mlp.*']"`) that must match a module's
  whole original path (`blocks.0.mlp.layer1`); `.*(_modulation|_norm|_embedder|final_layer).*` is always
  excluded, and an include pattern brings a module back;
- `network_reg_dims` / `network_reg_lrs`: `regex=value,...`, the first regex matching the whole path wins;
- `verbose=True`.

The original path of a module is its name in the original file (anima/layout.py original_path), the name sd-scripts
matches against; Qwen3's are its own (`layers.0.self_attn.q_proj`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from library.core.errors import ConfigError
from networks.lora_rules import parse_bool

DEFAULT_EXCLUDE = r".*(_modulation|_norm|_embedder|final_layer).*"
KEYS = ("train_llm_adapter", "exclude_patterns", "include_patterns", "network_reg_dims", "network_reg_lrs", "verbose")


def _patterns(key: str, text: Optional[str]) -> tuple[re.Pattern, ...]:
    if text is None:
        return ()
    try:
        value = ast.literal_eval(str(text))
    except (ValueError, SyntaxError):
        value = str(text)  # a bare regex, as one would write it in a TOML string
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        try:
            out.append(re.compile(str(item)))
        except re.error as e:
            raise ConfigError(f"--network_args {key}: {item!r} is not a regular expression ({e})") from None
    return tuple(out)


def _regex_values(key: str, text: Optional[str], cast, what: str) -> tuple[tuple[re.Pattern, float], ...]:
    """`regex=value,...` as sd-scripts splits it (each pair at its first `=`)."""
    if text is None:
        return ()
    rules = []
    for pair in str(text).split(","):
        pair = pair.strip()
        if not pair:
            continue
        pattern, sep, value = pair.partition("=")
        try:
            if not sep:
                raise ValueError
            number = cast(value.strip())
            if number < 0:
                raise ValueError
            rules.append((re.compile(pattern.strip()), number))
        except (ValueError, re.error):
            raise ConfigError(f"--network_args {key}: expected regex={what}, got {pair!r}") from None
    return tuple(rules)


@dataclass
class AnimaModuleRules:
    """The parsed Anima arguments (networks/lora_rules.py ModuleRules), asked per kohya module name."""

    paths: Mapping[str, str]  # kohya name -> original path
    train_llm_adapter: bool = False
    exclude: tuple[re.Pattern, ...] = ()
    include: tuple[re.Pattern, ...] = ()
    reg_dims: tuple = field(default_factory=tuple)
    reg_lrs: tuple = field(default_factory=tuple)
    verbose: bool = False

    def enables(self, key: str) -> bool:
        return key == "train_llm_adapter" and self.train_llm_adapter

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        path = self.paths.get(name)
        if path is None:
            return default
        if any(p.fullmatch(path) for p in self.exclude) and not any(p.fullmatch(path) for p in self.include):
            return 0
        return next((d for p, d in self.reg_dims if p.fullmatch(path)), default)

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        path = self.paths.get(name)
        if path is None:
            return None
        return next(((i, lr) for i, (p, lr) in enumerate(self.reg_lrs) if p.fullmatch(path)), None)


class AnimaNetworkArgs:
    """Anima's networks.lora arguments for one model (its kohya names -> original paths)."""

    keys = KEYS

    def __init__(self, paths: Mapping[str, str]):
        self.paths = dict(paths)

    def parse(self, raw: Mapping[str, str]) -> AnimaModuleRules:
        return AnimaModuleRules(
            paths=self.paths, train_llm_adapter=parse_bool("train_llm_adapter", raw.get("train_llm_adapter")),
            exclude=_patterns("exclude_patterns", raw.get("exclude_patterns")) + (re.compile(DEFAULT_EXCLUDE),),
            include=_patterns("include_patterns", raw.get("include_patterns")),
            reg_dims=_regex_values("network_reg_dims", raw.get("network_reg_dims"), int, "an integer >= 0"),
            reg_lrs=_regex_values("network_reg_lrs", raw.get("network_reg_lrs"), float, "a number >= 0"),
            verbose=parse_bool("verbose", raw.get("verbose")))
