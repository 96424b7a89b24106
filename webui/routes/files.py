"""A job's files: samples, trained files, any file inside its folder, the TensorBoard event files."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, Response

from webui.context import Ctx, JobId, clean_path_param
from webui.desktop import open_folder, opener_problem
from webui.jobfiles import PlantedLink

router = APIRouter()


@router.get("/api/jobs/{job_id}/samples")
def samples(ctx: Ctx, job_id: JobId) -> list[dict[str, Any]]:
    ctx.job_or_404(job_id)
    return ctx.folder(job_id).sample_images()


@router.get("/api/jobs/{job_id}/files/{path:path}")
def job_file(ctx: Ctx, job_id: JobId, path: str) -> Response:
    ctx.job_or_404(job_id)
    target = ctx.folder(job_id).resolve(clean_path_param(path, "path"))
    if target is None:
        raise HTTPException(403, "outside the job's folder")
    if not os.path.isfile(target):
        raise HTTPException(404, "no such file")
    return FileResponse(target)


@router.get("/api/jobs/{job_id}/trained")
def trained(ctx: Ctx, job_id: JobId) -> list[dict[str, Any]]:
    """The trained files, for download through /files/."""
    ctx.job_or_404(job_id)
    return ctx.folder(job_id).trained_files()


@router.delete("/api/jobs/{job_id}/tensorboard_events")
def delete_events(ctx: Ctx, job_id: JobId, confirm: str = Query("")) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    if confirm != "yes":
        raise HTTPException(400, "repeat with ?confirm=yes to delete the job's TensorBoard event files")
    try:
        return {"deleted": ctx.folder(job_id).delete_event_files()}
    except PlantedLink as e:
        raise HTTPException(409, str(e)) from None


@router.post("/api/jobs/{job_id}/open_folder")
def open_job_folder(ctx: Ctx, job_id: JobId, request: Request) -> dict[str, Any]:
    """Open the job's folder in the file manager of the server's desktop (browser and server on one machine);
    409 with the reason when that cannot be done here."""
    ctx.job_or_404(job_id)
    problem = opener_problem(request.client.host if request.client else None)
    if problem:
        raise HTTPException(409, problem)
    folder = ctx.own_folder(job_id).path
    open_folder(folder)
    return {"opened": folder}
