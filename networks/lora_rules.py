"""Per-module dims and learning rates that a model family's own `--network_args` give networks.lora.

A family declares the arguments it understands beyond the generic ones of
networks/lora_args.py with an object following `NetworkArgRules` (FLUX.1:
library/families/flux/network_args.py) and hangs it on its `LoraTarget`s. The
network then asks the parsed `ModuleRules` one question per module: its dim
(0: no module), its learning rate, and whether an optional target is on. Nothing
here knows any model; `RegexValues` is the `regex=value,...` list that
`network_reg_dims` / `network_reg_lrs` use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, Optional, Protocol, TypeVar

from library.core.errors import ConfigError

T = TypeVar("T", int, float)


class ModuleRules(Protocol):
    """The parsed family arguments, asked per kohya module name."""

    verbose: bool  # log every module's dim and alpha

    def enables(self, key: str) -> bool:
        """Whether the optional targets whose `enabled_by` is `key` get modules."""

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        """The dim of module `name` given the generic `default`; 0 or None: no module."""

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        """(rule index, learning rate) when a rule gives module `name` its own rate, else None."""

    # Optional: `split(name) -> bool`, True when the fused module `name` trains one LoRA per projection
    # (sd-scripts' split_qkv; networks/lora_fused.py FusedLoRAModule split). Rules without it never split.


class NetworkArgRules(Protocol):
    """A family's own networks.lora arguments: the keys it reads and how to parse them."""

    keys: tuple[str, ...]

    def parse(self, raw: Mapping[str, str]) -> ModuleRules:
        """Check the family's `--network_args` strings (a ConfigError naming the key) and return the rules."""


def rules_of(targets: list) -> Optional[NetworkArgRules]:
    """The family arguments the targets carry (one object per family), or None."""
    found = {id(t.network_args): t.network_args for t in targets if getattr(t, "network_args", None) is not None}
    if len(found) > 1:
        raise ValueError("LoraTargets carry different network_args objects; a family hangs one on all its targets")
    return next(iter(found.values()), None)


@dataclass(frozen=True)
class RegexValues(Generic[T]):
    """`regex=value,regex=value`: the value of the FIRST pattern that `re.search`-matches a module name.

    First match is what sd-scripts' code does (its docs say the last one wins);
    the files users already have were trained that way.
    """

    rules: tuple[tuple[re.Pattern, T], ...] = ()

    def first_match(self, name: str) -> Optional[tuple[int, T]]:
        """(index of the rule, its value) of the first rule matching `name`, or None."""
        for i, (pattern, value) in enumerate(self.rules):
            if pattern.search(name):
                return i, value
        return None


def parse_regex_values(key: str, text: str, cast: Callable[[str], T], what: str) -> RegexValues[T]:
    """Parse `regex=value,...` for `--network_args key` (a regex cannot hold a comma here, as in sd-scripts)."""
    rules = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        pattern, sep, value = item.rpartition("=")
        if not sep or not pattern.strip():
            raise ConfigError(f"--network_args {key}: expected regex={what}[,regex={what}...], got {item!r}")
        try:
            compiled = re.compile(pattern.strip())
        except re.error as e:
            raise ConfigError(f"--network_args {key}: {pattern.strip()!r} is not a regular expression ({e})") from None
        rules.append((compiled, parse_number(key, value, cast, what)))
    return RegexValues(tuple(rules))


def parse_number(key: str, value: str, cast: Callable[[str], T], what: str) -> T:
    """`value` as a number >= 0, or a one-line ConfigError naming `--network_args key`."""
    try:
        number = cast(str(value).strip())
    except ValueError:
        number = None
    if number is None or number < 0:
        raise ConfigError(f"--network_args {key}: expected {what}, got {str(value).strip()!r}")
    return number


TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no", "none", "")


def parse_bool(key: str, value: Optional[str]) -> bool:
    """True / False (any case, or 1 / 0); None (not given) is False."""
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ConfigError(f"--network_args {key}: expected True or False, got {str(value).strip()!r}")
