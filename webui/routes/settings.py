"""A job's settings: read, save (checked as a Start would be), revert, the history, Performance options."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from webui.context import Ctx, JobId, RevisionId
from webui.jobfiles import templates
from webui.routes.models import Settings
from webui.store import ACTIVE

router = APIRouter()


def _not_active(job: dict[str, Any], what: str = "stop it first") -> None:
    if job["status"] in ACTIVE:
        raise HTTPException(409, f"the job is queued or running: {what}")


@router.get("/api/jobs/{job_id}/settings")
def get_settings(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return ctx.folder(job_id).settings()


@router.put("/api/jobs/{job_id}/settings")
def put_settings(ctx: Ctx, job_id: JobId, body: Settings) -> dict[str, Any]:
    job = ctx.job_or_404(job_id)
    _not_active(job, "stop it before changing its settings")
    return ctx.check_and_write(job, body.as_settings())


@router.get("/api/jobs/{job_id}/check")
def start_check(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    """Whether Start will work: every check of a Save on the job's files as they are (a job made from a
    template with placeholder paths, or files edited by hand, may fail it). `ok`, else the one-line `error` and
    its `field`; `placeholders`: the settings still to fill in; `run_length`: whether steps or epochs govern."""
    return ctx.start_check(ctx.job_or_404(job_id))


@router.post("/api/jobs/{job_id}/revert")
def revert_settings(ctx: Ctx, job_id: JobId) -> dict[str, Any]:
    """Danger zone: the template's settings again."""
    job = ctx.job_or_404(job_id)
    _not_active(job)
    t = templates().get(job["template"])
    if t is None:
        raise HTTPException(404, f"template {job['template']!r} no longer exists")
    return ctx.check_and_write(job, {"config": t["config"], "dataset": t["dataset"],
                                     "prompts": t.get("prompts", []), "launch": {}},
                               check=False, what="reverted to the template")


@router.get("/api/jobs/{job_id}/performance")
def performance_availability(ctx: Ctx, job_id: JobId) -> list[dict[str, Any]]:
    """The Performance options, each with whether this machine, the family and the trainer can use it and
    why not (the page disables those; a save that turns one on is refused with 422)."""
    return ctx.performance_options(ctx.job_or_404(job_id))


@router.get("/api/jobs/{job_id}/revisions")
def revisions(ctx: Ctx, job_id: JobId) -> list[dict[str, Any]]:
    """The settings history, newest first: id, time, what changed."""
    ctx.job_or_404(job_id)
    return ctx.store.revisions(job_id)


def _revision_or_404(ctx: Ctx, job_id: int, revision_id: int) -> dict[str, Any]:
    rev = ctx.store.revision(job_id, revision_id)
    if rev is None:
        raise HTTPException(404, f"job {job_id} has no settings revision {revision_id}")
    return rev


@router.get("/api/jobs/{job_id}/revisions/{revision_id}")
def revision(ctx: Ctx, job_id: JobId, revision_id: RevisionId) -> dict[str, Any]:
    ctx.job_or_404(job_id)
    return _revision_or_404(ctx, job_id, revision_id)


@router.post("/api/jobs/{job_id}/revisions/{revision_id}/restore")
def restore_revision(ctx: Ctx, job_id: JobId, revision_id: RevisionId) -> dict[str, Any]:
    """The settings of an earlier save again, checked as a save is (and kept as a new revision)."""
    job = ctx.job_or_404(job_id)
    _not_active(job)
    rev = _revision_or_404(ctx, job_id, revision_id)
    return ctx.check_and_write(job, rev["settings"], what=f"restored revision {revision_id}")
