"""The model families, as the trainer declares them: `python -m library.cli.describe --describe_families` is run
once for the server's life (the web UI imports no trainer code). Which script trains a family in a mode, which
--model_type values a job of a family that shares its scripts must have, which families can swap blocks, and the
labels of its text encoders and denoiser all come from these facts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any, Optional

from webui.jobfiles import REPO_ROOT, find_key

_FACTS: dict[str, dict[str, Any]] = {}
_LOCK = threading.Lock()


class FamiliesUnknown(RuntimeError):
    """The trainer could not describe its families (its one-line reason)."""


def families(timeout: float = 120) -> dict[str, dict[str, Any]]:
    """{family name: its facts}, in the registry's order; learned once."""
    with _LOCK:
        if not _FACTS:
            try:
                result = subprocess.run([sys.executable, "-m", "library.cli.describe", "--describe_families"],
                                        check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                                        stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise FamiliesUnknown(f"the trainer did not describe its families: {e}") from e
            if result.returncode != 0:
                last = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise FamiliesUnknown(f"the trainer did not describe its families: {last}")
            for facts in json.loads(result.stdout)["families"]:
                _FACTS[facts["name"]] = facts
        return dict(_FACTS)


def facts(family: str) -> dict[str, Any]:
    known = families()
    if family not in known:
        raise KeyError(f"unknown family {family!r} (known: {', '.join(known)})")
    return known[family]


def script_for(family: str, mode: str) -> str:
    scripts = facts(family)["scripts"]
    if mode not in scripts:
        raise KeyError(f"no {mode} script for {family} (it has: {', '.join(scripts)})")
    return scripts[mode]


def all_scripts() -> list[str]:
    return sorted({script for f in families().values() for script in f["scripts"].values()})


def block_swap_families() -> list[str]:
    return [name for name, f in families().items() if f["block_swap"]]


def model_type_refusal(family: str, config: dict) -> Optional[tuple[str, str]]:
    """(one-line error, field) when config.toml's model_type is not the job family's (a job of a family that
    shares its scripts, told by --model_type, would train another model with the same script), else None."""
    allowed = facts(family)["model_types"]
    if not allowed:
        return None
    section = find_key(config, "model_type")
    value = None if section is None else (config if section == "" else config[section])["model_type"]
    value = None if value == "" else value  # a blank field is no value
    if value in allowed:
        return None
    want = " or ".join("blank" if a is None else f'"{a}"' for a in allowed)
    got = "blank" if value is None else f'"{value}"' if isinstance(value, str) else repr(value)
    return (f"model_type: a {family} job needs model_type {want} (its scripts train the model it names), "
            f"got {got}"), "model_type"
