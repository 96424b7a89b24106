"""Test generation and the running job's control folder: generate, sample now, save now."""

from __future__ import annotations

import os
from typing import Any, Optional

from fastapi import APIRouter, Body, HTTPException

from library.core.io_utils import atomic_write_text
from webui.context import Ctx, JobId, refuse
from webui.generation import generate_command, request_control
from webui.routes.models import Generate

router = APIRouter()


def _running(ctx: Ctx, job_id: int) -> dict[str, Any]:
    ctx.runner.refresh()
    job = ctx.job_or_404(job_id)
    if job["status"] != "running":
        raise HTTPException(409, f"job {job_id} is {job['status']}, not running: start it first")
    return job


@router.post("/api/jobs/{job_id}/sample_now", status_code=202)
def sample_now(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    """The running job generates its sample prompts at its next step (into the gallery)."""
    _running(ctx, job_id)
    folder = ctx.own_folder(job_id)
    if not ctx.folder(job_id).settings()["prompts"]:
        raise HTTPException(409, "the job has no sample prompts: add some in Sampling (and save) before a run")
    request_control(folder, "sample")
    return {"requested": "sample", "when": "at the next step"}


@router.post("/api/jobs/{job_id}/save_now", status_code=202)
def save_now(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    """The running job saves its model (and a state with save_state) at its next step, under its step name."""
    _running(ctx, job_id)
    request_control(ctx.own_folder(job_id), "save")
    return {"requested": "save", "when": "at the next step"}


@router.get("/api/jobs/{job_id}/generate")
def generation_state(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return ctx.generations.state(job_id)


@router.post("/api/jobs/{job_id}/generate", status_code=202)
def generate(ctx: Ctx, job_id: JobId, body: Optional[Generate] = Body(None)) -> dict[str, Any]:
    """tools/generate.py with the job's base model and its newest trained file (or `checkpoint`), the prompts
    given or the job's own; the images go to the job's gallery. 202 while it runs (GET for its state)."""
    body = body or Generate()
    job = ctx.job_or_404(job_id)
    folder = ctx.own_folder(job_id)
    settings = folder.settings()
    trained = folder.trained_files()
    if body.checkpoint:
        names = {t["name"]: t for t in trained}
        if body.checkpoint not in names:
            raise refuse(422, f"checkpoint {body.checkpoint!r}: not a trained file of the job; one of "
                              f"{', '.join(sorted(names)) or 'none yet'}", "checkpoint")
        checkpoint = os.path.join(folder.path, names[body.checkpoint]["path"])
    elif trained:
        checkpoint = os.path.join(folder.path, trained[0]["path"])
    elif job["mode"] in ("lora", "controlnet_lllite"):
        raise HTTPException(409, "the job has no trained LoRA yet: train it (or Save now during a run) first"
                            if job["mode"] == "lora" else "the job has no trained ControlNet-LLLite file yet: train it "
                            "(or Save now during a run) first")
    else:
        checkpoint = None  # a fine-tune job without a trained file: the base model itself
    prompts = [p.replace("\n", " ").strip() for p in (body.prompts or settings["prompts"]) if p and p.strip()]
    if not prompts:
        raise refuse(422, "prompts: give at least one prompt (the job has no sample prompts)", "prompts")
    prompts_path = os.path.join(folder.path, "generate_prompts.txt")
    atomic_write_text(prompts_path, "\n".join(prompts) + "\n")
    argv = generate_command(folder, job["mode"], settings["config"], prompts_path, checkpoint, body.steps,
                            body.width, body.height, body.seed)
    state = ctx.generations.start(job_id, os.path.join(folder.path, "generate.log"), argv)
    if state is None:
        raise HTTPException(409, "a generation of this job is running: wait for it")
    return state
