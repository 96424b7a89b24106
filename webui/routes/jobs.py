"""Jobs: templates, create, list, rename, duplicate, delete."""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

from fastapi import APIRouter, Body, HTTPException, Query

from webui.context import MAX_NAME, Ctx, JobId, refuse
from webui.jobfiles import templates
from webui.routes.models import Duplicate, JobChanges, NewJob
from webui.runner import LAUNCHERS
from webui.store import ACTIVE

router = APIRouter()


def clean_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise refuse(422, "name: expected a non-empty text", "name")
    name = " ".join(name.split())
    if len(name) > MAX_NAME:
        raise refuse(422, f"name: at most {MAX_NAME} characters", "name")
    return name


def unique_name(ctx, name: str, job_id: Optional[int] = None) -> str:
    """`name`, or with the first free suffix " (2)", " (3)", ... when another job has it (names are unique)."""
    taken = {j["name"] for j in ctx.store.jobs() if j["id"] != job_id}
    if name not in taken:
        return name
    n = 2
    while True:
        suffix = f" ({n})"
        candidate = name[:MAX_NAME - len(suffix)] + suffix
        if candidate not in taken:
            return candidate
        n += 1


def clean_launcher(launcher: Any) -> str:
    if not isinstance(launcher, str) or launcher not in LAUNCHERS:
        raise refuse(422, f"launcher: one of {', '.join(LAUNCHERS)}", "launcher")
    return launcher


@router.get("/api/templates")
def list_templates() -> list[dict[str, Any]]:
    return [{"name": name, **t["template"]} for name, t in templates().items()]


@router.get("/api/jobs")
def list_jobs(ctx: Ctx) -> list[dict[str, Any]]:
    ctx.runner.refresh()
    return [ctx.describe(j) for j in ctx.store.jobs()]


@router.post("/api/jobs", status_code=201)
def create_job(ctx: Ctx, body: NewJob) -> dict[str, Any]:
    all_templates = templates()
    if body.template not in all_templates:
        raise refuse(422, f"template: unknown template {body.template!r}; one of {', '.join(sorted(all_templates))}",
                     "template")
    t = all_templates[body.template]
    launcher = clean_launcher(body.launcher if body.launcher is not None else ctx.default_launcher)
    job_id = ctx.store.create_job(unique_name(ctx, clean_name(body.name or t["template"]["title"])), body.template,
                                  t["template"]["family"], t["template"]["mode"], launcher)
    folder = ctx.folder(job_id)
    folder.write_settings({"config": t["config"], "dataset": t["dataset"], "prompts": t.get("prompts", [])})
    ctx.store.add_revision(job_id, folder.settings(), f"created from the template {body.template}")
    return ctx.describe(ctx.store.job(job_id))


@router.get("/api/jobs/{job_id}")
def get_job(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.runner.refresh()
    return ctx.describe(ctx.job_or_404(job_id))


@router.post("/api/jobs/{job_id}/duplicate", status_code=201)
def duplicate_job(ctx: Ctx, job_id: JobId, body: Optional[Duplicate] = Body(None)) -> dict[str, Any]:
    job = ctx.job_or_404(job_id)
    name = clean_name((body.name if body else None) or f"{job['name']} (copy)"[:MAX_NAME])
    new_id = ctx.store.create_job(unique_name(ctx, name), job["template"], job["family"], job["mode"], job["launcher"])
    source, copy = ctx.folder(job_id), ctx.folder(new_id)
    copy.write_settings(source.settings())
    if os.path.isfile(source.accelerate_config_path) and not os.path.islink(source.accelerate_config_path):
        shutil.copyfile(source.accelerate_config_path, copy.accelerate_config_path)
    ctx.store.add_revision(new_id, copy.settings(), f"duplicated from job {job_id}")
    return ctx.describe(ctx.store.job(new_id))


@router.patch("/api/jobs/{job_id}")
def update_job(ctx: Ctx, job_id: JobId, body: JobChanges) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    values = {}
    if "name" in body.model_fields_set:
        values["name"] = unique_name(ctx, clean_name(body.name), job_id)
    if "launcher" in body.model_fields_set:
        values["launcher"] = clean_launcher(body.launcher)
    if values:
        ctx.store.update_job(job_id, **values)
    return ctx.describe(ctx.store.job(job_id))


@router.delete("/api/jobs/{job_id}")
def delete_job(ctx: Ctx, job_id: JobId, confirm: str = Query("")) -> dict[str, Any]:
    job = ctx.job_or_404(job_id)
    if confirm != "yes":
        raise HTTPException(400, "deleting a job removes its folder and trained files: repeat with ?confirm=yes")
    ctx.runner.refresh()
    if ctx.store.job(job_id)["status"] in ACTIVE:
        raise HTTPException(409, "the job is queued or running: stop it first")
    folder = ctx.folder(job["id"]).path
    ctx.boards.stop(job_id)
    if os.path.islink(folder):  # never follow a link out of the jobs folder
        os.unlink(folder)
    elif os.path.isdir(folder) and os.path.dirname(os.path.realpath(folder)) == os.path.realpath(ctx.jobs_dir):
        shutil.rmtree(folder)
    ctx.store.delete_job(job_id)
    return {"deleted": job_id}
