"""Checks a Save makes beyond the trainer's --check_config, which reads no model file: the files and folders
the run will read exist, and which of max_train_steps / max_train_epochs governs the run's length."""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional

from webui.folders import MODEL_ID_KEYS, READ_PATH_KEYS, config_values, is_model_id, resolved

PLACEHOLDER_PREFIX = "/models/"  # the full-size templates' model paths: to fill in
# Read-path settings a run creates when missing (a cache folder, DeepSpeed's NVMe swap): not checked.
CREATED_KEYS = ("tokenizer_cache_dir", "offload_optimizer_nvme_path", "offload_param_nvme_path")
EXISTING_KEYS = tuple(k for k in READ_PATH_KEYS if k not in CREATED_KEYS)


def missing_inputs(config: dict) -> Iterator[tuple[str, str, str]]:
    """(key, value, one-line error) of every file or folder the run reads that does not exist (relative paths
    from the toolkit's folder, where runs start); a preset, a hub id and resume = "auto" are no paths."""
    for key, value in config_values(config, EXISTING_KEYS):
        if not isinstance(value, str) or not value or (key == "resume" and value == "auto"):
            continue
        if key in MODEL_ID_KEYS and is_model_id(value):
            continue
        if os.path.exists(resolved(value)):
            continue
        yield key, value, f"{key} {value}: no such file or folder"


def first_missing_input(config: dict) -> Optional[tuple[str, str]]:
    """(one-line error, field) of the first missing input, or None."""
    for key, _, error in missing_inputs(config):
        return error, key
    return None


def placeholders(config: dict) -> list[str]:
    """The keys whose value is still a template placeholder (`/models/...` that does not exist)."""
    return [key for key, value, _ in missing_inputs(config) if value.startswith(PLACEHOLDER_PREFIX)]


def _number(config: dict, key: str) -> Optional[int]:
    values = [v for _, v in config_values(config, (key,)) if isinstance(v, int) and not isinstance(v, bool)]
    return values[-1] if values else None


def run_length(config: dict) -> dict[str, Any]:
    """Which setting governs the run's length, as sd-scripts decides it: max_train_epochs, when given (> 0),
    overrides max_train_steps; else max_train_steps (the trainer's default 1600)."""
    steps, epochs = _number(config, "max_train_steps"), _number(config, "max_train_epochs")
    if epochs:
        note = f"max_train_epochs {epochs} governs: the run trains {epochs} epochs"
        if steps is not None:
            note += f"; max_train_steps {steps} is overridden (sd-scripts' rule: epochs, when given, win)"
        return {"governs": "max_train_epochs", "overridden": "max_train_steps" if steps is not None else None,
                "note": note}
    note = (f"max_train_steps {steps} governs" if steps is not None else
            "max_train_steps governs (the trainer's default, 1600)") + \
        "; set max_train_epochs to train a number of epochs instead (it overrides max steps)"
    return {"governs": "max_train_steps", "overridden": None, "note": note}
