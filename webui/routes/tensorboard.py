"""A TensorBoard per job, on the job's output/logs/."""

from __future__ import annotations

import os
import shlex
from typing import Any

from fastapi import APIRouter

from webui.context import Ctx, JobId

router = APIRouter()


def _logdir(ctx: Ctx, job_id: int) -> str:
    return os.path.join(ctx.folder(job_id).output_dir, "logs")


def _with_logdir(ctx: Ctx, job_id: int, status: dict[str, Any]) -> dict[str, Any]:
    """The status plus the logs directory and the command that shows it without the UI (the page's "Logs" line)."""
    logdir = _logdir(ctx, job_id)
    return {**status, "logdir": logdir, "command": f"tensorboard --logdir {shlex.quote(logdir)}"}


@router.get("/api/jobs/{job_id}/tensorboard")
def tensorboard_status(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return _with_logdir(ctx, job_id, ctx.boards.status(job_id))


@router.post("/api/jobs/{job_id}/tensorboard")
def tensorboard_start(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    folder = ctx.own_folder(job_id)
    return _with_logdir(ctx, job_id, ctx.boards.start(job_id, _logdir(ctx, job_id),
                                                      os.path.join(folder.path, "tensorboard.log")))


@router.delete("/api/jobs/{job_id}/tensorboard")
def tensorboard_stop(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return _with_logdir(ctx, job_id, ctx.boards.stop(job_id))
