"""Captioning from the page (webui/captioning.py): start a captioner on a folder, follow it."""

from __future__ import annotations

import os
import threading
from typing import Any

from fastapi import APIRouter, HTTPException

from webui.captioning import CAPTIONERS, caption_command, count_captions
from webui.context import Ctx, clean_path_param, refuse
from webui.folders import count_images, image_files, within
from webui.routes.models import Caption

router = APIRouter()
_lock = threading.Lock()  # one start at a time (the busy-folder check and the new id)


def _allowed(ctx: Ctx, path: str, field: str, want_dir: bool) -> str:
    """`path` resolved, inside the data roots or the jobs folder (a job's uploaded dataset); else 403/422."""
    path = clean_path_param(path, field).strip()
    real = ctx.roots.inside(path)
    if real is None:
        candidate = os.path.realpath(path)
        real = candidate if os.path.isabs(path) and within(candidate, ctx.jobs_dir) else None
    if real is None:
        raise refuse(403, f"{field} {path}: outside the folders the server may read (add it under Data first)", field)
    if not (os.path.isdir(real) if want_dir else os.path.exists(real)):
        raise refuse(422, f"{field} {path}: no such {'folder' if want_dir else 'file or folder'} on the server", field)
    return real


@router.get("/api/captioners")
def captioners() -> list[dict[str, Any]]:
    return [{"name": k, "label": c.label, "model_flag": c.model_flag, "extension": c.extension}
            for k, c in CAPTIONERS.items()]


@router.post("/api/captioning", status_code=202)
def start_captioning(ctx: Ctx, body: Caption) -> dict[str, Any]:
    folder = _allowed(ctx, body.folder, "folder", want_dir=True)
    model = _allowed(ctx, body.model, "model", want_dir=False)
    if count_images(folder) == 0:
        raise refuse(422, f"folder {body.folder}: no images to caption", "folder")
    extension = body.caption_extension or CAPTIONERS[body.captioner].extension
    argv = caption_command(body.captioner, folder, model, extension, body.recursive, body.overwrite,
                           body.threshold, body.batch_size)
    with _lock:
        tasks = ctx.caption_tasks
        busy = [i for i, t in tasks.items() if t["folder"] == folder
                and ctx.captioning.state(i).get("status") == "running"]
        if busy:
            raise HTTPException(409, f"{folder} is being captioned already (captioning {busy[0]})")
        task_id = len(tasks) + 1
        tasks[task_id] = {"folder": folder, "extension": extension, "recursive": body.recursive}
    logs = os.path.join(ctx.jobs_dir, ".captioning")
    os.makedirs(logs, exist_ok=True)
    ctx.captioning.start(task_id, os.path.join(logs, f"{task_id}.log"), argv)
    return captioning_state(ctx, task_id)


@router.get("/api/captioning/{task_id}")
def captioning_state(ctx: Ctx, task_id: int) -> dict[str, Any]:
    task = ctx.caption_tasks.get(task_id)
    if task is None:
        raise HTTPException(404, f"no captioning {task_id}")
    state = ctx.captioning.state(task_id)
    return {**state, "id": task_id, "folder": task["folder"], "extension": task["extension"],
            "images": count_images(task["folder"]) if task["recursive"] else len(image_files(task["folder"])),
            "captions": count_captions(task["folder"], task["extension"], task["recursive"])}

