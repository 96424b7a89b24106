"""The families and each script's flags, as the trainer describes them (`--describe_families`,
`--describe_flags`, learned once): the settings form is drawn from them (webui/static/form.js)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from webui import families as fam
from webui.performance import trainer_description

router = APIRouter()


def _families() -> dict[str, dict[str, Any]]:
    try:
        return fam.families()
    except fam.FamiliesUnknown as e:
        raise HTTPException(503, str(e)) from e


@router.get("/api/families")
def list_families() -> dict[str, dict[str, Any]]:
    """{family: its facts}: scripts per mode, model types, text-encoder labels, denoiser label, block swap,
    component-file flags, ..."""
    return _families()


@router.get("/api/describe/{family}/{mode}")
def describe(family: str, mode: str) -> dict[str, Any]:
    """Every flag of the script that trains `family` in `mode` (name, type, default, choices, help, group, range,
    ...) with the family's facts (a family that shares its scripts gets its own facts, not the script's default)."""
    known = _families()
    if family not in known:
        raise HTTPException(404, f"family: unknown family {family!r}; one of {', '.join(known)}")
    scripts = known[family]["scripts"]
    if mode not in scripts:
        raise HTTPException(404, f"mode: {family} has no {mode!r} script; one of {', '.join(scripts)}")
    description = trainer_description(scripts[mode])
    if description is None:
        raise HTTPException(503, f"{scripts[mode]} --describe_flags failed (run it by hand to see why)")
    return {**description, "family": known[family]}
