"""The HTTP API and the page (FastAPI). Every route works on the job's folder and the SQLite store;
training itself is reached only through webui.runner (subprocesses and signals)."""

from __future__ import annotations

import hmac
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Optional

from fastapi import Body, FastAPI, HTTPException, Path, Query, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from webui import logs, performance
from webui.folders import Roots, missing_dataset_folders, settings_path_refusal
from webui.hardware import gpus
from webui.history import changes
from webui.jobfiles import (IMAGE_EXTENSIONS, REPO_ROOT, JobFolder, PlantedLink, SettingsError, model_type_refusal,
                            script_for, templates)
from webui.multigpu import clean_launch, write_accelerate_config
from webui.runner import LAUNCHERS, Runner, gpu_environment, shown_command, training_command
from webui.store import ACTIVE, Store
from webui.tensorboard import TensorBoards

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
TOKEN_COOKIE = "webui_token"
MAX_NAME = 120
MAX_ID = 2**63 - 1  # SQLite's largest INTEGER: a larger id names no job (404), it is not a server error
# Job and revision ids in a route: an integer 1..MAX_ID, else 404 (see ids_outside_the_store below).
JobId = Annotated[int, Path(ge=1, le=MAX_ID)]
RevisionId = Annotated[int, Path(ge=1, le=MAX_ID)]
_OFFSET_RE = re.compile(r"[0-9]{1,18}")  # a Last-Event-ID byte offset


def clean_path_param(value: str, what: str) -> str:
    """A path from the URL: 400 when it holds a NUL (no file has one; the OS calls would raise)."""
    if "\0" in value:
        raise HTTPException(400, f"{what}: a path cannot contain a NUL character")
    return value


def create_app(jobs_dir: str, token: Optional[str] = None, stop_timeout: float = 60.0,
               default_launcher: str = "python", data_roots: Optional[list[str]] = None,
               find_gpus=gpus) -> FastAPI:
    """`find_gpus`: the GPUs of this machine (webui.hardware.gpus; tests give a stand-in list)."""
    jobs_dir = os.path.abspath(jobs_dir)
    roots = Roots(data_roots or [REPO_ROOT, os.getcwd()])
    os.makedirs(jobs_dir, exist_ok=True)
    store = Store(os.path.join(jobs_dir, "jobs.sqlite3"))
    runner = Runner(store, jobs_dir, stop_timeout=stop_timeout)
    app = FastAPI(title="Training jobs", docs_url=None, redoc_url=None, openapi_url=None)
    boards = TensorBoards()
    app.state.store, app.state.runner, app.state.tensorboards = store, runner, boards

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if token:
            given = (request.headers.get("authorization", "").removeprefix("Bearer ").strip()
                     or request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE) or "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                return JSONResponse({"detail": "token required: open the page as /?token=YOUR_TOKEN "
                                               "or send 'Authorization: Bearer YOUR_TOKEN'"}, status_code=401)
        response = await call_next(request)
        if token and request.query_params.get("token"):
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(RequestValidationError)
    async def ids_outside_the_store(request: Request, exc: RequestValidationError):
        """A job or revision id in the path that is no integer in 1..MAX_ID names nothing: 404 (FastAPI's
        422 stays for the query and the body)."""
        bad = [e["loc"][1] for e in exc.errors() if tuple(e.get("loc", ()))[:1] == ("path",)]
        if bad:
            given = request.path_params
            detail = (f"no job {given.get('job_id')}" if "job_id" in bad else
                      f"job {given.get('job_id')} has no settings revision {given.get('revision_id')}")
            return JSONResponse({"detail": detail}, status_code=404)
        return await request_validation_exception_handler(request, exc)

    # --- helpers -------------------------------------------------------------------------------------
    def job_or_404(job_id: int) -> dict[str, Any]:
        job = store.job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job

    def own_folder(job_id: int) -> JobFolder:
        """The job's folder, 409 when it, output/ or output/logs/ is a symbolic link (the UI makes none; a run,
        TensorBoard or a deletion through one would write or delete outside the jobs folder)."""
        folder = JobFolder(jobs_dir, job_id)
        link = folder.planted_link()
        if link is not None:
            raise HTTPException(409, f"{link}: a symbolic link, not the job's own folder: not followed "
                                     "(remove the link)")
        return folder

    def describe(job: dict[str, Any]) -> dict[str, Any]:
        folder = JobFolder(jobs_dir, job["id"])
        return {**job, "folder": folder.path, "script": script_for(job["family"], job["mode"]),
                "command": shown_command(training_command(job, folder), gpu_environment(folder))}

    def clean_name(name: Any) -> str:
        if not isinstance(name, str) or not name.strip():
            raise HTTPException(422, {"error": "name: expected a non-empty text", "field": "name"})
        name = " ".join(name.split())
        if len(name) > MAX_NAME:
            raise HTTPException(422, {"error": f"name: at most {MAX_NAME} characters", "field": "name"})
        return name

    def performance_options(job: dict[str, Any]) -> list[dict[str, Any]]:
        return performance.availability(job["family"], script_for(job["family"], job["mode"]), len(find_gpus()))

    def check_and_write(job: dict[str, Any], settings: dict[str, Any], check: bool = True,
                        what: Optional[str] = None) -> dict[str, Any]:
        """Refuse paths outside the job's folder and the roots (403), names that are paths (422) and options
        this machine cannot use (422) at once, then run the trainer's check and the accelerate config
        generator; write; keep a revision. Returns the settings. `check` False: the settings are the server's
        own template (as when a job is created): no path nor trainer check."""
        folder = own_folder(job["id"])
        refused_path = settings_path_refusal(settings, folder.path, roots) if check else None
        if refused_path:
            status, error, field = refused_path
            raise HTTPException(status, {"error": error, "field": field})
        if check:
            for key, path, where in missing_dataset_folders(settings.get("dataset") or {}):
                what = "file" if key == "metadata_file" else "folder"
                raise HTTPException(422, {"error": f"dataset.toml: {where}.{key}: no such {what}: {path}",
                                          "field": key, "where": where})
        config = settings["config"]
        for section in config.values():  # "Block swap count" 0 is off: no flag (the trainer wants >= 1)
            if isinstance(section, dict) and section.get("blocks_to_swap") == 0:
                del section["blocks_to_swap"]
        refused = model_type_refusal(job["family"], config) or performance.refusal(config, performance_options(job))
        if refused:
            raise HTTPException(422, {"error": refused[0], "field": refused[1]})
        scratch_config = os.path.join(folder.path, ".accelerate_config.yaml")
        try:
            gpu_indices = [g["index"] for g in find_gpus()]
            settings["launch"] = clean_launch(settings.get("launch"), gpu_indices, job["mode"])
            jobs = []  # the trainer's check and the accelerate config generator: two processes, run side by side
            if settings["launch"].get("strategy"):
                flags = {k: performance.config_value(config, k) for k in ("mixed_precision", "gradient_accumulation_steps")}
                jobs.append(lambda: write_accelerate_config(settings["launch"], job["family"], job["mode"], flags,
                                                            scratch_config, cpu=not gpu_indices))
            if check:
                jobs.append(lambda: folder.check_settings(settings, script_for(job["family"], job["mode"])))
            with ThreadPoolExecutor(2) as pool:
                for future in [pool.submit(j) for j in jobs]:
                    future.result()  # the generator's refusal first, then the trainer's
        except SettingsError as e:
            if os.path.exists(scratch_config):
                os.remove(scratch_config)
            raise HTTPException(422, {"error": str(e), "field": e.field, "where": e.where}) from None
        previous = store.last_revision(job["id"])
        folder.write_settings(settings)
        if os.path.isfile(scratch_config):
            os.replace(scratch_config, folder.accelerate_config_path)
        elif os.path.exists(folder.accelerate_config_path):
            os.remove(folder.accelerate_config_path)  # no strategy: one process, no accelerate config
        saved = folder.settings()
        summary = changes(previous["settings"] if previous else None, saved)
        store.add_revision(job["id"], saved, f"{what}: {summary}" if what else summary)
        return saved

    # --- page ----------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"), headers={"Cache-Control": "no-store"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    # --- jobs ----------------------------------------------------------------------------------------
    @app.get("/api/templates")
    def list_templates() -> list[dict[str, Any]]:
        return [{"name": name, **t["template"]} for name, t in templates().items()]

    @app.get("/api/jobs")
    def list_jobs() -> list[dict[str, Any]]:
        runner.refresh()
        return [describe(j) for j in store.jobs()]

    @app.post("/api/jobs", status_code=201)
    def create_job(body: dict = Body(...)) -> dict[str, Any]:
        all_templates = templates()
        name = body.get("template")
        if not isinstance(name, str) or name not in all_templates:
            raise HTTPException(422, {"error": f"template: unknown template {name!r}; one of "
                                               f"{', '.join(sorted(all_templates))}", "field": "template"})
        t = all_templates[name]
        launcher = body.get("launcher", default_launcher)
        if not isinstance(launcher, str) or launcher not in LAUNCHERS:
            raise HTTPException(422, {"error": f"launcher: one of {', '.join(LAUNCHERS)}", "field": "launcher"})
        job_id = store.create_job(clean_name(body.get("name") or t["template"]["title"]), name,
                                  t["template"]["family"], t["template"]["mode"], launcher)
        job = store.job(job_id)
        folder = JobFolder(jobs_dir, job_id)
        folder.write_settings({"config": t["config"], "dataset": t["dataset"], "prompts": t.get("prompts", [])})
        store.add_revision(job_id, folder.settings(), f"created from the template {name}")
        return describe(job)

    @app.get("/api/jobs/{job_id}")
    def get_job(job_id: JobId) -> dict[str, Any]:
        runner.refresh()
        return describe(job_or_404(job_id))

    @app.post("/api/jobs/{job_id}/duplicate", status_code=201)
    def duplicate_job(job_id: JobId, body: Optional[dict] = Body(None)) -> dict[str, Any]:
        job = job_or_404(job_id)
        name = clean_name((body or {}).get("name") or f"{job['name']} (copy)"[:MAX_NAME])
        new_id = store.create_job(name, job["template"], job["family"], job["mode"], job["launcher"])
        source, copy = JobFolder(jobs_dir, job_id), JobFolder(jobs_dir, new_id)
        copy.write_settings(source.settings())
        if os.path.isfile(source.accelerate_config_path) and not os.path.islink(source.accelerate_config_path):
            shutil.copyfile(source.accelerate_config_path, copy.accelerate_config_path)
        store.add_revision(new_id, copy.settings(), f"duplicated from job {job_id}")
        return describe(store.job(new_id))

    @app.patch("/api/jobs/{job_id}")
    def update_job(job_id: JobId, body: dict = Body(...)) -> dict[str, Any]:
        job_or_404(job_id)
        values = {}
        if "name" in body:
            values["name"] = clean_name(body["name"])
        if "launcher" in body:
            if not isinstance(body["launcher"], str) or body["launcher"] not in LAUNCHERS:
                raise HTTPException(422, {"error": f"launcher: one of {', '.join(LAUNCHERS)}", "field": "launcher"})
            values["launcher"] = body["launcher"]
        if values:
            store.update_job(job_id, **values)
        return describe(store.job(job_id))

    @app.delete("/api/jobs/{job_id}")
    def delete_job(job_id: JobId, confirm: str = Query("")) -> dict[str, Any]:
        job = job_or_404(job_id)
        if confirm != "yes":
            raise HTTPException(400, "deleting a job removes its folder and trained files: repeat with ?confirm=yes")
        runner.refresh()
        if store.job(job_id)["status"] in ACTIVE:
            raise HTTPException(409, "the job is queued or running: stop it first")
        folder = JobFolder(jobs_dir, job["id"]).path
        boards.stop(job_id)
        if os.path.islink(folder):  # never follow a link out of the jobs folder
            os.unlink(folder)
        elif os.path.isdir(folder) and os.path.dirname(os.path.realpath(folder)) == os.path.realpath(jobs_dir):
            shutil.rmtree(folder)
        store.delete_job(job_id)
        return {"deleted": job_id}

    # --- settings ------------------------------------------------------------------------------------
    @app.get("/api/jobs/{job_id}/settings")
    def get_settings(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        return JobFolder(jobs_dir, job_id).settings()

    @app.put("/api/jobs/{job_id}/settings")
    def put_settings(job_id: JobId, body: dict = Body(...)) -> dict[str, Any]:
        job = job_or_404(job_id)
        if job["status"] in ACTIVE:
            raise HTTPException(409, "the job is queued or running: stop it before changing its settings")
        settings = {"config": body.get("config") or {}, "dataset": body.get("dataset") or {},
                    "prompts": body.get("prompts") or [], "launch": body.get("launch") or {}}
        if not isinstance(settings["config"], dict) or not isinstance(settings["dataset"], dict) \
                or not isinstance(settings["prompts"], list) or not isinstance(settings["launch"], dict):
            raise HTTPException(422, {"error": "expected {config: {...}, dataset: {...}, prompts: [...], "
                                               "launch: {...}}", "field": None})
        if not all(isinstance(p, str) for p in settings["prompts"]):
            raise HTTPException(422, {"error": "prompts: expected a list of texts", "field": "prompts"})
        return check_and_write(job, settings)

    @app.post("/api/jobs/{job_id}/revert")
    def revert_settings(job_id: JobId) -> dict[str, Any]:
        """Danger zone: the template's settings again."""
        job = job_or_404(job_id)
        if job["status"] in ACTIVE:
            raise HTTPException(409, "the job is queued or running: stop it first")
        t = templates().get(job["template"])
        if t is None:
            raise HTTPException(404, f"template {job['template']!r} no longer exists")
        return check_and_write(job, {"config": t["config"], "dataset": t["dataset"], "prompts": t.get("prompts", []),
                                     "launch": {}}, check=False, what="reverted to the template")

    @app.get("/api/jobs/{job_id}/performance")
    def performance_availability(job_id: JobId) -> list[dict[str, Any]]:
        """The Performance options, each with whether this machine, the family and the trainer can use it and
        why not (the page disables those; a save that turns one on is refused with 422)."""
        return performance_options(job_or_404(job_id))

    @app.get("/api/jobs/{job_id}/revisions")
    def revisions(job_id: JobId) -> list[dict[str, Any]]:
        """The settings history, newest first: id, time, what changed."""
        job_or_404(job_id)
        return store.revisions(job_id)

    @app.get("/api/jobs/{job_id}/revisions/{revision_id}")
    def revision(job_id: JobId, revision_id: RevisionId) -> dict[str, Any]:
        job_or_404(job_id)
        rev = store.revision(job_id, revision_id)
        if rev is None:
            raise HTTPException(404, f"job {job_id} has no settings revision {revision_id}")
        return rev

    @app.post("/api/jobs/{job_id}/revisions/{revision_id}/restore")
    def restore_revision(job_id: JobId, revision_id: RevisionId) -> dict[str, Any]:
        """The settings of an earlier save again, checked as a save is (and kept as a new revision)."""
        job = job_or_404(job_id)
        if job["status"] in ACTIVE:
            raise HTTPException(409, "the job is queued or running: stop it first")
        rev = store.revision(job_id, revision_id)
        if rev is None:
            raise HTTPException(404, f"job {job_id} has no settings revision {revision_id}")
        return check_and_write(job, rev["settings"], what=f"restored revision {revision_id}")

    # --- runs ----------------------------------------------------------------------------------------
    @app.post("/api/jobs/{job_id}/start")
    def start_job(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        own_folder(job_id)
        return {"status": runner.start(job_id), "job": describe(store.job(job_id))}

    @app.post("/api/jobs/{job_id}/stop")
    def stop_job(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        return {"status": runner.stop(job_id), "job": describe(store.job(job_id))}

    @app.get("/api/jobs/{job_id}/status")
    def job_status(job_id: JobId) -> dict[str, Any]:
        runner.refresh()
        job = job_or_404(job_id)
        folder = JobFolder(jobs_dir, job_id)
        return {"status": job["status"], "pid": job["pid"], "exit_code": job["exit_code"],
                "progress": logs.progress(folder.log_path), "command": describe(job)["command"],
                "runs": store.runs(job_id)}

    @app.get("/api/jobs/{job_id}/log")
    def log_stream(job_id: JobId, request: Request, follow: bool = True) -> StreamingResponse:
        """Server-sent events: the log's lines (event id = byte offset, so a reconnect goes on where it
        stopped), "Waiting for training to start..." while there is no log, and an `end` event when the
        job is not running and everything was sent."""
        job_or_404(job_id)
        folder = JobFolder(jobs_dir, job_id)
        last = request.headers.get("last-event-id", "")
        offset = int(last) if _OFFSET_RE.fullmatch(last) else 0

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
                runner.refresh()
                job = store.job(job_id)
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

    @app.get("/api/jobs/{job_id}/history")
    def loss_history(job_id: JobId) -> list[dict[str, Any]]:
        """Loss and LR by step, parsed from the log (the console's chart)."""
        job_or_404(job_id)
        return logs.history(JobFolder(jobs_dir, job_id).log_path)

    @app.get("/api/jobs/{job_id}/samples")
    def samples(job_id: JobId) -> list[dict[str, Any]]:
        job_or_404(job_id)
        return JobFolder(jobs_dir, job_id).sample_images()

    @app.get("/api/jobs/{job_id}/files/{path:path}")
    def job_file(job_id: JobId, path: str) -> Response:
        job_or_404(job_id)
        target = JobFolder(jobs_dir, job_id).resolve(clean_path_param(path, "path"))
        if target is None:
            raise HTTPException(403, "outside the job's folder")
        if not os.path.isfile(target):
            raise HTTPException(404, "no such file")
        return FileResponse(target)

    @app.get("/api/jobs/{job_id}/trained")
    def trained(job_id: JobId) -> list[dict[str, Any]]:
        """The trained files, for download through /files/."""
        job_or_404(job_id)
        return JobFolder(jobs_dir, job_id).trained_files()

    @app.delete("/api/jobs/{job_id}/tensorboard_events")
    def delete_events(job_id: JobId, confirm: str = Query("")) -> dict[str, Any]:
        job_or_404(job_id)
        if confirm != "yes":
            raise HTTPException(400, "repeat with ?confirm=yes to delete the job's TensorBoard event files")
        try:
            return {"deleted": JobFolder(jobs_dir, job_id).delete_event_files()}
        except PlantedLink as e:
            raise HTTPException(409, str(e)) from None

    @app.get("/api/jobs/{job_id}/tensorboard")
    def tensorboard_status(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        return boards.status(job_id)

    @app.post("/api/jobs/{job_id}/tensorboard")
    def tensorboard_start(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        folder = own_folder(job_id)
        return boards.start(job_id, os.path.join(folder.output_dir, "logs"), os.path.join(folder.path, "tensorboard.log"))

    @app.delete("/api/jobs/{job_id}/tensorboard")
    def tensorboard_stop(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        return boards.stop(job_id)

    @app.get("/api/hardware")
    def hardware() -> dict[str, Any]:
        return {"gpus": find_gpus(), "none": "No GPU: training runs on CPU"}

    @app.get("/api/folders")
    def folders(path: str = "") -> dict[str, Any]:
        """The folder picker: subfolders with image counts, the folder's image count and first images."""
        try:
            return roots.listing(clean_path_param(path, "path") or None)
        except PermissionError:
            raise HTTPException(403, "outside the allowed folders") from None
        except FileNotFoundError:
            raise HTTPException(404, "no such folder") from None

    @app.get("/api/image")
    def image(path: str) -> FileResponse:
        """An image inside the allowed folders (the thumbnail strip)."""
        real = roots.inside(clean_path_param(path, "path"))
        if real is None:
            raise HTTPException(403, "outside the allowed folders")
        if not os.path.isfile(real) or not real.lower().endswith(IMAGE_EXTENSIONS):
            raise HTTPException(404, "no such image")
        return FileResponse(real)

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        return {"jobs_dir": jobs_dir, "repo_root": REPO_ROOT, "launchers": list(LAUNCHERS), "data_roots": roots.roots}

    app.state.describe = describe
    return app
