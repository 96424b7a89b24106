"""Datasets and the machine: the folder picker, images inside the allowed folders, hardware, server info."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

from webui.context import Ctx, clean_path_param
from webui.jobfiles import IMAGE_EXTENSIONS, REPO_ROOT
from webui.runner import LAUNCHERS

router = APIRouter()


@router.get("/api/hardware")
def hardware(ctx: Ctx) -> dict[str, Any]:
    return {"gpus": ctx.find_gpus(), "none": "No GPU: training runs on CPU"}


@router.get("/api/folders")
def folders(ctx: Ctx, path: str = "") -> dict[str, Any]:
    """The folder picker: subfolders with image counts, the folder's image count and first images."""
    try:
        return ctx.roots.listing(clean_path_param(path, "path") or None)
    except PermissionError:
        raise HTTPException(403, "outside the allowed folders") from None
    except FileNotFoundError:
        raise HTTPException(404, "no such folder") from None


@router.get("/api/image")
def image(ctx: Ctx, path: str) -> FileResponse:
    """An image inside the allowed folders (the thumbnail strip)."""
    real = ctx.roots.inside(clean_path_param(path, "path"))
    if real is None:
        raise HTTPException(403, "outside the allowed folders")
    if not os.path.isfile(real) or not real.lower().endswith(IMAGE_EXTENSIONS):
        raise HTTPException(404, "no such image")
    return FileResponse(real)


@router.get("/api/info")
def info(ctx: Ctx) -> dict[str, Any]:
    return {"jobs_dir": ctx.jobs_dir, "repo_root": REPO_ROOT, "launchers": list(LAUNCHERS),
            "data_roots": ctx.roots.roots}
