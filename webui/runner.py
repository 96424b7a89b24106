"""Starting, stopping and watching training runs: subprocesses with argument lists, in their own process
group, detached from the server (a restarted server re-attaches by pid + process start time)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import toml

from webui.families import script_for
from webui.jobfiles import REPO_ROOT, JobFolder, open_for_append
from webui.store import Store

LAUNCHERS = ("python", "accelerate")


def process_start_time(pid: int) -> Optional[str]:
    """The start time of a live process (clock ticks since boot, /proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields and fields[0] == "Z":  # a zombie is not running
        return None
    return fields[19] if len(fields) > 19 else None


def gpu_environment(folder: JobFolder) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES from the job's GPU selection (launch.toml), when it has one."""
    try:
        ids = toml.load(folder.launch_path).get("gpu_ids") or []
    except (OSError, ValueError):
        ids = []
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids)} if ids else {}


def training_command(job: dict[str, Any], folder: JobFolder) -> list[str]:
    """The command a user can run by hand (from the repository root) to do what the UI does: with a generated
    accelerate config (a multi-GPU strategy), `accelerate launch --config_file <job>/accelerate_config.yaml`."""
    script = script_for(job["family"], job["mode"])
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    if os.path.isfile(folder.accelerate_config_path):
        return [accelerate, "launch", "--config_file", folder.accelerate_config_path, script,
                "--config_file", folder.config_path]
    if job["launcher"] == "accelerate":
        head = [accelerate, "launch", "--num_cpu_threads_per_process",
                "1", script]
    else:
        head = [sys.executable, script]
    return head + ["--config_file", folder.config_path]


def shown_command(argv: list[str], env: Optional[dict[str, str]] = None) -> str:
    shown = ["accelerate" if a.endswith(os.sep + "accelerate") else a for a in argv]
    if shown[0] == sys.executable:
        shown[0] = "python"
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return f"cd {shlex.quote(REPO_ROOT)} && {prefix}" + shlex.join(shown)


class Runner:
    """One training run at a time; a job started while another runs is queued and starts when it ends."""

    def __init__(self, store: Store, jobs_dir: str, stop_timeout: float = 60.0, max_running: int = 1,
                 max_retries: int = 2):
        self.store = store
        self.max_retries = max_retries
        self.jobs_dir = jobs_dir
        self.stop_timeout = stop_timeout
        self.max_running = max_running
        self._children: dict[int, subprocess.Popen] = {}
        self._lock = threading.RLock()
        self.refresh()  # re-attach to the runs a previous server started

    def folder(self, job_id: int) -> JobFolder:
        return JobFolder(self.jobs_dir, job_id)

    # --- control ---------------------------------------------------------------------------------
    def start(self, job_id: int) -> str:
        with self._lock:
            self.refresh()
            job = self.store.job(job_id)
            if job["status"] in ("queued", "running"):
                return job["status"]
            self.store.update_job(job_id, retries=0)  # a start by hand: the crash retries count anew
            running = [j for j in self.store.jobs() if j["status"] == "running"]
            if len(running) >= self.max_running:
                self.store.update_job(job_id, status="queued", stop_requested=0, exit_code=None)
                return "queued"
            self._launch(job)
            return "running"

    def _launch(self, job: dict[str, Any]) -> None:
        folder = self.folder(job["id"])
        if folder.planted_link() is not None:  # the API refuses to start it (409); a queued one fails unstarted
            self.store.update_job(job["id"], status="failed", exit_code=None, pid=None, pid_start=None)
            return
        argv = training_command(job, folder)
        gpu_env = gpu_environment(folder)
        if os.path.exists(folder.exit_code_path):
            os.remove(folder.exit_code_path)
        with open_for_append(folder.log_path) as log:
            log.write(f"$ {shown_command(argv, gpu_env)}\n".encode())
            log.flush()
            child = subprocess.Popen([sys.executable, "-m", "webui.launch", folder.exit_code_path, "--", *argv],
                                     cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                                          "PYTHONPATH": REPO_ROOT, **gpu_env})
        self._children[job["id"]] = child
        self.store.update_job(job["id"], status="running", pid=child.pid, pid_start=process_start_time(child.pid),
                              exit_code=None, stop_requested=0)
        self.store.add_run(job["id"], shown_command(argv, gpu_env))

    def stop(self, job_id: int) -> str:
        """SIGINT to the run's process group (the trainer saves a state and stops), SIGTERM after the timeout."""
        with self._lock:
            self.refresh()
            job = self.store.job(job_id)
            if job["status"] == "queued":
                self.store.update_job(job_id, status="stopped", stop_requested=1)
                return "stopped"
            if job["status"] != "running":
                return job["status"]
            self.store.update_job(job_id, stop_requested=1)
            pid, start = job["pid"], job["pid_start"]
        self._signal(pid, start, signal.SIGINT)
        timer = threading.Timer(self.stop_timeout, self._signal, (pid, start, signal.SIGTERM))
        timer.daemon = True
        timer.start()
        return "stopping"

    @staticmethod
    def _signal(pid: int, start: Optional[str], signum: int) -> None:
        if process_start_time(pid) == start:  # the same process, not a later one with the pid
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                pass

    # --- status ----------------------------------------------------------------------------------
    def alive(self, job: dict[str, Any]) -> bool:
        child = self._children.get(job["id"])
        if child is not None:
            return child.poll() is None
        return bool(job["pid"]) and process_start_time(job["pid"]) == job["pid_start"]

    def refresh(self) -> None:
        """Bring each job's status up to date with its process; start queued jobs when there is room."""
        with self._lock:
            for job in self.store.jobs():
                if job["status"] == "running" and not self.alive(job):
                    self._children.pop(job["id"], None)
                    self._finish(job)
            queued = [j for j in self.store.jobs() if j["status"] == "queued"]
            running = sum(1 for j in self.store.jobs() if j["status"] == "running")
            for job in queued[:max(0, self.max_running - running)]:
                self._launch(job)

    def _finish(self, job: dict[str, Any]) -> None:
        code = None
        try:
            with open(self.folder(job["id"]).exit_code_path, encoding="utf-8") as f:
                code = int(f.read().strip())
        except (OSError, ValueError):
            pass
        if code == 0:
            status = "finished"
        elif job["stop_requested"] and code is not None and code > 128 or code in (130, 143):
            status = "stopped"
        else:
            status = "failed"
        self.store.update_job(job["id"], status=status, exit_code=code, pid=None, pid_start=None)
        self.store.end_run(job["id"], status, code)
        if status == "failed" and self._resumes_after_crash(job, code):
            with open_for_append(self.folder(job["id"]).log_path) as log:
                log.write(f"[webui] the run ended with exit code {code}; auto-resume: retry "
                          f"{job['retries'] + 1} of {self.max_retries}\n".encode())
            self.store.update_job(job["id"], status="queued", retries=job["retries"] + 1)

    def _resumes_after_crash(self, job: dict[str, Any], code: Optional[int]) -> bool:
        """A crash (killed, out of memory, an exception; not exit code 2, the trainer's one-line refusal of
        the settings) of a job with resume = "auto" is retried, at most max_retries times in a row."""
        if code == 2 or job["stop_requested"] or job["retries"] >= self.max_retries:
            return False
        try:
            config = toml.load(self.folder(job["id"]).config_path)
        except (OSError, ValueError):
            return False
        values = [v.get("resume") for v in config.values() if isinstance(v, dict)] + [config.get("resume")]
        return "auto" in values

    def wait(self, job_id: int, timeout: float) -> str:
        """Block until the job is neither queued nor running (tests, scripts); returns its status."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.refresh()
            status = self.store.job(job_id)["status"]
            if status not in ("queued", "running"):
                return status
            time.sleep(0.2)
        return self.store.job(job_id)["status"]
