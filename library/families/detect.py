"""Which family a model path belongs to, from cheap evidence: preset names, a diffusers folder's
model_index.json, or the tensor names in a .safetensors header (no weights are read).

The evidence is each family's own facts (`ModelFamily.presets`, `single_file_markers`, `contents`,
`diffusers_class_markers`, `detect_rank`), read through the registry: this module names no family."""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

from library.families import family_names, get_family
from library.families.base import ModelFamily

# What a single file holds when it is one family's part that any family may take (for "expected X, found Y").
_COMPONENT_CONTENTS = (
    ("lora_", "a LoRA"),
    ("encoder.block.", "a T5 text encoder"),
    ("text_model.encoder.layers.", "a CLIP text encoder"),
    ("encoder.layers.", "a CLIP text encoder"),
    ("encoder.conv_in.", "an autoencoder"),
    ("first_stage_model.", "an autoencoder"),
)


def _families() -> list[ModelFamily]:
    """Every registered family, most specific first."""
    return sorted((get_family(name) for name in family_names()), key=lambda f: (f.detect_rank, f.name))


def _preset_family(path: str) -> Optional[str]:
    for family in _families():
        if path in family.presets():
            return family.name
    return None


def _folder_family(path: str) -> Optional[str]:
    try:
        with open(os.path.join(path, "model_index.json"), encoding="utf-8") as f:
            cls = json.load(f).get("_class_name", "")
    except (OSError, ValueError):
        return None
    for family in _families():
        if any(marker in cls for marker in family.diffusers_class_markers):
            return family.name
    return None


def _file_family(path: str) -> Optional[str]:
    if not path.lower().endswith(".safetensors"):
        return None  # a pickle cannot be inspected without loading it
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - not a readable safetensors file: let the loader say why
        return None
    for family in _families():  # the most specific marker wins (SDXL files also have the SD one)
        if any(k.startswith(family.single_file_markers) for k in keys):
            return family.name
    return None


def describe_keys(keys: Iterable[str]) -> str:
    """What a checkpoint's tensor names say it holds ("a T5 text encoder", "an SDXL checkpoint", ...)."""
    keys = list(keys)
    table = [pair for family in _families() for pair in family.contents] + list(_COMPONENT_CONTENTS)
    for prefix, what in table:
        if any(k.startswith(prefix) for k in keys):
            return what
    return f"unrecognised tensors ({', '.join(keys[:3]) or 'none'})"


def detect_family(path: str) -> Optional[str]:
    """The name of the registered family the path belongs to, or None when the path does not tell (then the
    caller's default applies)."""
    if path.startswith(("tiny:", "random:")):
        return _preset_family(path)
    if os.path.isdir(path):
        return _folder_family(path)
    if os.path.isfile(path):
        return _file_family(path)
    return None
