"""What every route shares: the jobs folder, the store, the runner, TensorBoard and the settings check.

One `WebContext` per app (`app.state.ctx`); the routers in webui/routes/ reach it through `Depends(context)`."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Callable, Optional

from fastapi import Depends, HTTPException, Path, Request

from webui import performance
from webui.checks import first_missing_input, placeholders, run_length
from webui.folders import Roots, missing_dataset_folders, settings_path_refusal
from webui.generation import Generations
from webui.history import changes
from webui.families import model_type_refusal, script_for
from webui.jobfiles import JobFolder, SettingsError
from webui.multigpu import clean_launch, write_accelerate_config
from webui.runner import Runner, gpu_environment, shown_command, training_command
from webui.store import Store
from webui.tensorboard import TensorBoards

MAX_NAME = 120
MAX_ID = 2**63 - 1  # SQLite's largest INTEGER: a larger id names no job (404), it is not a server error
# Job and revision ids in a route: an integer 1..MAX_ID, else 404 (webui.app's ids_outside_the_store).
JobId = Annotated[int, Path(ge=1, le=MAX_ID)]
RevisionId = Annotated[int, Path(ge=1, le=MAX_ID)]
OFFSET_RE = re.compile(r"[0-9]{1,18}")  # a Last-Event-ID byte offset


def clean_path_param(value: str, what: str) -> str:
    """A path from the URL: 400 when it holds a NUL (no file has one; the OS calls would raise)."""
    if "\0" in value:
        raise HTTPException(400, f"{what}: a path cannot contain a NUL character")
    return value


def refuse(status: int, error: str, field: Optional[str] = None, **more: Any) -> HTTPException:
    """The API's refusal: `{"detail": {"error": one line, "field": the setting it is about, ...}}`."""
    return HTTPException(status, {"error": error, "field": field, **more})


class WebContext:
    def __init__(self, jobs_dir: str, roots: Roots, stop_timeout: float, default_launcher: str,
                 find_gpus: Callable[[], list[dict[str, Any]]]):
        self.jobs_dir = jobs_dir
        self.roots = roots
        self.base_roots = list(roots.roots)  # --data_root; more are added from the page (webui/routes/datasets.py)
        self.default_launcher = default_launcher
        self.find_gpus = find_gpus
        os.makedirs(jobs_dir, exist_ok=True)
        self.store = Store(os.path.join(jobs_dir, "jobs.sqlite3"))
        self.runner = Runner(self.store, jobs_dir, stop_timeout=stop_timeout)
        self.boards = TensorBoards()
        self.generations = Generations()
        self.captioning = Generations()  # captioners on folders (webui/routes/captioning.py)
        self.caption_tasks: dict[int, dict[str, Any]] = {}  # id -> folder, extension, recursive
        self._checked: dict[int, tuple[Any, dict[str, Any]]] = {}  # job id -> (what was checked, the answer)

    def folder(self, job_id: int) -> JobFolder:
        return JobFolder(self.jobs_dir, job_id)

    def job_or_404(self, job_id: int) -> dict[str, Any]:
        job = self.store.job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job

    def own_folder(self, job_id: int) -> JobFolder:
        """The job's folder, 409 when it, output/ or output/logs/ is a symbolic link (the UI makes none; a run,
        TensorBoard or a deletion through one would write or delete outside the jobs folder)."""
        folder = self.folder(job_id)
        link = folder.planted_link()
        if link is not None:
            raise HTTPException(409, f"{link}: a symbolic link, not the job's own folder: not followed "
                                     "(remove the link)")
        return folder

    def describe(self, job: dict[str, Any]) -> dict[str, Any]:
        folder = self.folder(job["id"])
        return {**job, "folder": folder.path, "script": script_for(job["family"], job["mode"]),
                "command": shown_command(training_command(job, folder), gpu_environment(folder)),
                "queue": self.queue_place(job), "resumable": folder.has_state()}

    def queue_place(self, job: dict[str, Any]) -> Optional[dict[str, Any]]:
        """A queued job's place: position (1: next to start) and what it waits for (the running job)."""
        if job["status"] != "queued":
            return None
        jobs = self.store.jobs()
        queued = [j["id"] for j in jobs if j["status"] == "queued"]
        running = [j for j in jobs if j["status"] == "running"]
        waits = (", ".join(f'job {j["id"]} "{j["name"]}" (running)' for j in running) if running
                 else "the next status refresh")
        return {"position": queued.index(job["id"]) + 1, "of": len(queued),
                "waits_for": f"{waits}: one run at a time"}

    def performance_options(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return performance.availability(job["family"], script_for(job["family"], job["mode"]),
                                        len(self.find_gpus()))

    def check(self, job: dict[str, Any], settings: dict[str, Any], check: bool = True) -> Optional[str]:
        """Every check a Start would meet, nothing written: paths contained (403), names that are paths (422),
        dataset folders (422), options this machine cannot use (422), the trainer's own --check_config and the
        accelerate config generator (422). Returns the scratch accelerate config's path when one was made
        (the caller moves it into place or removes it). `check` False: the server's own template: no path nor
        trainer check."""
        folder = self.own_folder(job["id"])
        refused_path = settings_path_refusal(settings, folder.path, self.roots) if check else None
        if refused_path:
            status, error, field = refused_path
            raise refuse(status, error, field)
        if check:
            for key, path, where in missing_dataset_folders(settings.get("dataset") or {}):
                what = "file" if key == "metadata_file" else "folder"
                raise refuse(422, f"dataset.toml: {where}.{key}: no such {what}: {path}", key, where=where)
            missing = first_missing_input(settings.get("config") or {})
            if missing:  # the trainer's check loads no model: a missing model file would fail only at Start
                raise refuse(422, *missing)
        config = settings["config"]
        for section in config.values():  # "Block swap count" 0 is off: no flag (the trainer wants >= 1)
            if isinstance(section, dict) and section.get("blocks_to_swap") == 0:
                del section["blocks_to_swap"]
        refused = model_type_refusal(job["family"], config) or performance.refusal(config, self.performance_options(job))
        if refused:
            raise refuse(422, refused[0], refused[1])
        scratch_config = os.path.join(folder.path, ".accelerate_config.yaml")
        try:
            gpu_indices = [g["index"] for g in self.find_gpus()]
            settings["launch"] = clean_launch(settings.get("launch"), gpu_indices, job["mode"])
            jobs = []  # the trainer's check and the accelerate config generator: two processes, run side by side
            if settings["launch"].get("strategy"):
                flags = {k: performance.config_value(config, k)
                         for k in ("mixed_precision", "gradient_accumulation_steps")}
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
            raise refuse(422, str(e), e.field, where=e.where) from None
        return scratch_config if os.path.isfile(scratch_config) else None

    def check_and_write(self, job: dict[str, Any], settings: dict[str, Any], check: bool = True,
                        what: Optional[str] = None) -> dict[str, Any]:
        """`check`, then write; keep a revision. Returns the settings as written."""
        scratch_config = self.check(job, settings, check)
        folder = self.folder(job["id"])
        previous = self.store.last_revision(job["id"])
        folder.write_settings(settings)
        if scratch_config:
            os.replace(scratch_config, folder.accelerate_config_path)
        elif os.path.exists(folder.accelerate_config_path):
            os.remove(folder.accelerate_config_path)  # no strategy: one process, no accelerate config
        saved = folder.settings()
        self._checked[job["id"]] = (self._check_key(job["id"]), self._answer(saved, None))
        summary = changes(previous["settings"] if previous else None, saved)
        self.store.add_revision(job["id"], saved, f"{what}: {summary}" if what else summary)
        return saved


    def _check_key(self, job_id: int) -> Any:
        folder = self.folder(job_id)
        stamp = []
        for path in (folder.config_path, folder.dataset_path, folder.prompts_path, folder.launch_path):
            try:
                st = os.stat(path)
                stamp.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamp.append(None)
        return tuple(stamp)

    @staticmethod
    def _answer(settings: dict[str, Any], refusal: Optional[HTTPException]) -> dict[str, Any]:
        detail = refusal.detail if refusal is not None else None
        if refusal is not None and not isinstance(detail, dict):
            detail = {"error": str(detail), "field": None}
        config = settings.get("config") or {}
        return {"ok": refusal is None, "error": detail and detail.get("error"), "field": detail and detail.get("field"),
                "where": detail and detail.get("where"), "placeholders": placeholders(config),
                "run_length": run_length(config)}

    def start_check(self, job: dict[str, Any]) -> dict[str, Any]:
        """Whether Start will work with the job's files as they are: every check of a Save, nothing written
        (cached until one of the job's files changes)."""
        key = self._check_key(job["id"])
        cached = self._checked.get(job["id"])
        if cached and cached[0] == key:
            return cached[1]
        settings = self.folder(job["id"]).settings()
        refusal = None
        try:
            scratch = self.check(job, settings)
            if scratch:
                os.remove(scratch)
        except HTTPException as e:
            refusal = e
        answer = self._answer(settings, refusal)
        self._checked[job["id"]] = (key, answer)
        return answer


def context(request: Request) -> WebContext:
    return request.app.state.ctx


Ctx = Annotated[WebContext, Depends(context)]
