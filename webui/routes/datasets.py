"""Datasets: folders the server may read added from the page (kept in <jobs_dir>/data_roots.json, no
restart), files uploaded into a job's dataset folder, and the job's config.toml / dataset.toml edited as text
(checked as a Save is)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import toml
from fastapi import APIRouter, HTTPException, Query, Request

from library.core.io_utils import atomic_write_text
from webui.context import Ctx, JobId, clean_path_param, refuse
from webui.folders import count_images
from webui.jobfiles import IMAGE_EXTENSIONS, MANAGED_KEYS, find_key
from webui.routes.models import DataRoot, RawSettings
from webui.store import ACTIVE

router = APIRouter()

UPLOAD_DIR = "dataset"  # <job>/dataset/: the job's own dataset folder
UPLOAD_EXTENSIONS = IMAGE_EXTENSIONS + (".txt", ".caption", ".npz")
MAX_UPLOAD = 64 * 2**20
_FILE_NAME = re.compile(r"^[^/\\\0]{1,200}$")


def added_roots_path(ctx) -> str:
    return os.path.join(ctx.jobs_dir, "data_roots.json")


def load_added_roots(ctx) -> list[str]:
    try:
        with open(added_roots_path(ctx), encoding="utf-8") as f:
            added = json.load(f)
    except (OSError, ValueError):
        return []
    return [p for p in added if isinstance(p, str) and os.path.isdir(p)] if isinstance(added, list) else []


@router.get("/api/data_roots")
def data_roots(ctx: Ctx) -> dict[str, Any]:
    return {"roots": ctx.roots.roots, "added": load_added_roots(ctx)}


@router.post("/api/data_roots", status_code=201)
def add_data_root(ctx: Ctx, body: DataRoot) -> dict[str, Any]:
    """Allow one more folder for datasets and model files, kept on the server (no restart)."""
    path = os.path.expanduser(clean_path_param(body.path, "path").strip())
    if not os.path.isabs(path):
        raise refuse(422, f"path {body.path!r}: expected an absolute folder path", "path")
    if not os.path.isdir(path):
        raise refuse(422, f"path {body.path}: no such folder on the server", "path")
    real = ctx.roots.add(path)
    added = [p for p in load_added_roots(ctx) if p != real] + [real]
    atomic_write_text(added_roots_path(ctx), json.dumps(added, indent=1) + "\n")
    return {"roots": ctx.roots.roots, "added": added, "images": count_images(real)}


@router.delete("/api/data_roots")
def remove_data_root(ctx: Ctx, path: str = Query(...)) -> dict[str, Any]:
    """Forget a folder added from the page (the --data_root ones stay)."""
    real = os.path.realpath(os.path.expanduser(clean_path_param(path, "path")))
    added = load_added_roots(ctx)
    if real not in added:
        raise HTTPException(404, f"{path}: not a folder added from the page")
    added.remove(real)
    atomic_write_text(added_roots_path(ctx), json.dumps(added, indent=1) + "\n")
    if real not in ctx.base_roots:
        ctx.roots.remove(real)
    return {"roots": ctx.roots.roots, "added": added}


@router.put("/api/jobs/{job_id}/dataset_files/{name}", status_code=201)
async def upload(ctx: Ctx, job_id: JobId, name: str, request: Request) -> dict[str, Any]:
    """One file (the request body) into the job's dataset folder <job>/dataset/ (drag and drop on the page):
    an image or its caption; returns the folder and its image count."""
    ctx.job_or_404(job_id)
    folder = ctx.own_folder(job_id)
    if not _FILE_NAME.match(name) or name in (".", "..") or name.startswith("."):
        raise refuse(422, f"name {name!r}: expected a file name (no folder part)", "name")
    if not name.lower().endswith(UPLOAD_EXTENSIONS):
        raise refuse(422, f"name {name!r}: expected an image or caption file ({', '.join(UPLOAD_EXTENSIONS)})", "name")
    data = await request.body()
    if len(data) > MAX_UPLOAD:
        raise HTTPException(413, f"{name}: larger than {MAX_UPLOAD // 2**20} MiB")
    target_dir = os.path.join(folder.path, UPLOAD_DIR)
    if os.path.islink(target_dir):
        raise HTTPException(409, f"{target_dir}: a symbolic link, not the job's own folder: not followed")
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, name)
    tmp = os.path.join(target_dir, f".{name}.{os.getpid()}.upload")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666), "wb") as f:
        f.write(data)
    os.replace(tmp, target)
    return {"folder": target_dir, "name": name, "images": count_images(target_dir)}


@router.get("/api/jobs/{job_id}/raw")
def raw_settings(ctx: Ctx, job_id: JobId) -> dict[str, str]:
    """config.toml and dataset.toml as the run reads them."""
    ctx.job_or_404(job_id)
    folder = ctx.folder(job_id)
    out = {}
    for key, path in (("config", folder.config_path), ("dataset", folder.dataset_path)):
        try:
            with open(path, encoding="utf-8") as f:
                out[key] = f.read()
        except OSError:
            out[key] = ""
    return out


@router.put("/api/jobs/{job_id}/raw")
def put_raw_settings(ctx: Ctx, job_id: JobId, body: RawSettings) -> dict[str, Any]:
    """The job's config.toml and dataset.toml from text, with every check of a Save (the UI's own keys,
    output_dir, logging_dir, dataset_config, sample_prompts, are set again; the prompts and GPUs stay)."""
    job = ctx.job_or_404(job_id)
    if job["status"] in ACTIVE:
        raise HTTPException(409, "the job is queued or running: stop it before changing its settings")
    parsed = {}
    for key, text in (("config", body.config), ("dataset", body.dataset)):
        try:
            parsed[key] = toml.loads(text)
        except (toml.TomlDecodeError, TypeError, ValueError, IndexError) as e:
            raise refuse(422, f"{key}.toml: not TOML: {e}", None, where=f"{key}.toml") from None
    for key in MANAGED_KEYS:  # the UI's own: set again on write
        while (section := find_key(parsed["config"], key)) is not None:
            (parsed["config"] if section == "" else parsed["config"][section]).pop(key)
    current = ctx.folder(job_id).settings()
    return ctx.check_and_write(job, {"config": parsed["config"], "dataset": parsed["dataset"],
                                     "prompts": current["prompts"], "launch": current["launch"]},
                               what="edited as text")
