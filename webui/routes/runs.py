"""Runs: start, stop, status, the log stream, the loss history."""

from __future__ import annotations

import os
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from webui import logs
from webui.hardware import process_group_memory
from webui.context import OFFSET_RE, Ctx, JobId
from webui.store import ACTIVE

router = APIRouter()


@router.post("/api/jobs/{job_id}/start")
def start_job(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    ctx.own_folder(job_id)
    return {"status": ctx.runner.start(job_id), "job": ctx.describe(ctx.store.job(job_id))}


@router.post("/api/jobs/{job_id}/stop")
def stop_job(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return {"status": ctx.runner.stop(job_id), "job": ctx.describe(ctx.store.job(job_id))}


@router.get("/api/jobs/{job_id}/status")
def job_status(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.runner.refresh()
    job = ctx.job_or_404(job_id)
    return {"status": job["status"], "pid": job["pid"], "exit_code": job["exit_code"],
            "progress": logs.progress(ctx.folder(job_id).log_path), "command": ctx.describe(job)["command"],
            "runs": ctx.store.runs(job_id)}


@router.get("/api/jobs/{job_id}/log")
def log_stream(ctx: Ctx, job_id: JobId, request: Request, follow: bool = True) -> StreamingResponse:
    """Server-sent events: the log's lines (event id = byte offset, so a reconnect goes on where it
    stopped), "Waiting for training to start..." while there is no log, and an `end` event when the
    job is not running and everything was sent."""
    ctx.job_or_404(job_id)
    folder = ctx.folder(job_id)
    last = request.headers.get("last-event-id", "")
    offset = int(last) if OFFSET_RE.fullmatch(last) else 0

    def events():
        nonlocal offset
        yield "retry: 2000\n\n"
        waiting_said = False
        partial_sent = ""
        while True:
            if not os.path.exists(folder.log_path) and not waiting_said:
                yield f"event: waiting\ndata: {logs.WAITING}\n\n"
                waiting_said = True
            lines, new_offset, rest = logs.read_lines(folder.log_path, offset)
            if lines:
                offset = new_offset
                yield f"id: {offset}\n" + "".join(f"data: {line}\n" for line in lines) + "\n"
                partial_sent = ""
                continue
            if rest.startswith("steps:") and rest != partial_sent:  # the bar being redrawn, shown now
                partial_sent = rest
                yield f"event: bar\ndata: {rest}\n\n"
            ctx.runner.refresh()
            job = ctx.store.job(job_id)
            if not follow or job is None or job["status"] not in ACTIVE:
                lines, offset, rest = logs.read_lines(folder.log_path, offset)
                lines += logs.split_lines(rest)
                offset += len(rest.encode())
                if lines:
                    yield f"id: {offset}\n" + "".join(f"data: {line}\n" for line in lines) + "\n"
                yield f"event: end\ndata: {job['status'] if job else 'deleted'}\n\n"
                return
            time.sleep(0.3)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.get("/api/jobs/{job_id}/history")
def loss_history(ctx: Ctx, job_id: JobId) -> list[dict[str, Any]]:
    """Loss and LR by step, parsed from the log (the console's chart)."""
    ctx.job_or_404(job_id)
    return logs.history(ctx.folder(job_id).log_path)


@router.get("/api/jobs/{job_id}/hardware")
def run_hardware(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    """The live hardware panel: the run's resident memory (its process group) and each GPU's memory and
    utilisation (nvidia-smi; none on a CPU machine)."""
    ctx.runner.refresh()
    job = ctx.job_or_404(job_id)
    running = job["status"] == "running" and job["pid"]
    return {"status": job["status"], "cpu": process_group_memory(job["pid"]) if running else None,
            "gpus": ctx.find_gpus()}
