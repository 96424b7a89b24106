"""--network_args parsing pieces the DiT families share: per-position dim lists and block selections."""

from __future__ import annotations

from typing import Mapping, Optional

from library.core.errors import ConfigError
from networks.lora_rules import (
    parse_number,
)


def dim_list(key: str, text: str, layout: str, count: int) -> list[int]:
    """A `--network_args` list of `count` dims >= 0 such as in_dims / emb_dims (brackets optional); `layout` names
    the positions in the error."""
    body = str(text).strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    items = body.split(",")
    what = f"{count} comma-separated integers >= 0 {layout}"
    if len(items) != count:
        raise ConfigError(f"--network_args {key}: expected {what}, got {len(items)} values")
    return [parse_number(key, item, int, what) for item in items]


def block_selection(key: str, raw: Mapping[str, str], count: int) -> Optional[frozenset[int]]:
    """"0,3-5" / "all" / "none" -> the chosen block indices (None: all of them)."""
    text = raw.get(key)
    if text is None or str(text).strip() == "all":
        return None
    text = str(text).strip()
    if text in ("none", ""):
        return frozenset()
    what = f"indices from 0 to {count - 1} like 0,3-5, or all, or none (this model has {count} blocks)"
    chosen: set[int] = set()
    for item in text.split(","):
        start, dash, end = item.strip().partition("-")
        try:
            first, last = int(start), int(end if dash else start)
        except ValueError:
            raise ConfigError(f"--network_args {key}: expected {what}, got {item.strip()!r}") from None
        if not 0 <= first <= last < count:
            raise ConfigError(f"--network_args {key}: expected {what}, got {item.strip()!r}")
        chosen.update(range(first, last + 1))
    return frozenset(chosen)


