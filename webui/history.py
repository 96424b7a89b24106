"""What changed between two saves of a job's settings, in one line for the settings history."""

from __future__ import annotations

import json
from typing import Any

MAX_SHOWN = 6


def flatten(settings: dict[str, Any]) -> dict[str, Any]:
    """{"config.optimizer.learning_rate": 0.001, "dataset.datasets[0].subsets[1].num_repeats": 2, ...};
    lists of tables are indexed, other lists are one value."""
    out: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else key)
        elif isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
        else:
            out[path] = node

    walk(settings, "")
    return out


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def _name(path: str) -> str:
    """The short name of a setting: the key, with its dataset table ("subsets[1].num_repeats")."""
    parts = path.split(".")
    if parts[0] == "dataset" and len(parts) > 2:
        return ".".join(p for p in parts[1:] if p != "datasets[0]") if len(parts) > 3 else parts[-1]
    return parts[-1]


def changes(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """'learning_rate: 0.001 -> 0.002; max_train_steps: 20 -> 40; +2 more'; 'no changes' when equal."""
    if old is None:
        return "first save"
    a, b = flatten(old), flatten(new)
    lines = []
    for path in sorted(set(a) | set(b), key=lambda p: (p.split(".")[0] != "config", p)):
        if a.get(path) == b.get(path) and (path in a) == (path in b):
            continue
        name = _name(path)
        if path not in a:
            lines.append(f"{name}: set to {_shown(b[path])}")
        elif path not in b:
            lines.append(f"{name}: removed (was {_shown(a[path])})")
        else:
            lines.append(f"{name}: {_shown(a[path])} -> {_shown(b[path])}")
    if not lines:
        return "no changes"
    more = f"; +{len(lines) - MAX_SHOWN} more" if len(lines) > MAX_SHOWN else ""
    return "; ".join(lines[:MAX_SHOWN]) + more
