"""A TensorBoard per job, on the job's output/logs/."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter

from webui.context import Ctx, JobId

router = APIRouter()


@router.get("/api/jobs/{job_id}/tensorboard")
def tensorboard_status(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return ctx.boards.status(job_id)


@router.post("/api/jobs/{job_id}/tensorboard")
def tensorboard_start(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    folder = ctx.own_folder(job_id)
    return ctx.boards.start(job_id, os.path.join(folder.output_dir, "logs"),
                            os.path.join(folder.path, "tensorboard.log"))


@router.delete("/api/jobs/{job_id}/tensorboard")
def tensorboard_stop(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return ctx.boards.stop(job_id)
