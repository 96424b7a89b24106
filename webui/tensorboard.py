"""A TensorBoard process per job, on a free loopback port, for the job's output/logs/."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from webui.jobfiles import open_for_append

NOT_RUNNING = "Not running"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorBoards:
    def __init__(self) -> None:
        self._running: dict[int, tuple[subprocess.Popen, int]] = {}
        self._lock = threading.Lock()

    def status(self, job_id: int) -> dict[str, Any]:
        with self._lock:
            entry = self._running.get(job_id)
            if entry is not None and entry[0].poll() is not None:
                del self._running[job_id]
                entry = None
        if entry is None:
            return {"running": False, "status": NOT_RUNNING, "url": None}
        return {"running": True, "status": f"Running on port {entry[1]}", "url": f"http://127.0.0.1:{entry[1]}/",
                "pid": entry[0].pid}

    def start(self, job_id: int, logdir: str, log_path: str) -> dict[str, Any]:
        if self.status(job_id)["running"]:
            return self.status(job_id)
        os.makedirs(logdir, exist_ok=True)
        port = free_port()
        with open_for_append(log_path) as log:
            child = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host",
                                      "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        with self._lock:
            self._running[job_id] = (child, port)
        return self.status(job_id)

    def stop(self, job_id: int, timeout: float = 10) -> dict[str, Any]:
        with self._lock:
            entry = self._running.pop(job_id, None)
        if entry is not None and entry[0].poll() is None:
            try:
                os.killpg(entry[0].pid, signal.SIGTERM)
                entry[0].wait(timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(entry[0].pid, signal.SIGKILL)
                entry[0].wait()
        return self.status(job_id)

    def stop_all(self) -> None:
        for job_id in list(self._running):
            self.stop(job_id)
