"""Test generation from the page: tools/generate.py as a subprocess with the job's base model, its trained LoRA
(or a chosen checkpoint) and prompts; the images go to the job's gallery (output/sample/). And the run's
control folder, through which a running job samples or saves at its next step (library/train/control.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from library.core.io_utils import atomic_write_text
from webui.folders import config_values
from webui.jobfiles import REPO_ROOT, JobFolder, open_for_append

CONTROL_DIR = ".control"  # library.train.control.CONTROL_DIR (the UI imports no trainer code; a test compares)
# Model-file settings of config.toml that tools/generate.py takes under the same flag name.
GENERATE_FILE_KEYS = ("ae", "byt5", "clip_g", "clip_l", "gemma2", "llm_adapter_path", "qwen3", "t5_tokenizer_path",
                      "t5xxl", "text_encoder", "vae")
GENERATE_DIR = "sample"  # output/sample/: the gallery


def request_control(folder: JobFolder, request: str) -> str:
    """Ask the running job for `request` ("sample" / "save") at its next step: a file in output/.control/."""
    path = os.path.join(folder.output_dir, CONTROL_DIR, request)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, f"{time.time()}\n")
    return path


def _first(config: dict, key: str) -> Any:
    values = [v for _, v in config_values(config, (key,))]
    return values[-1] if values else None


def generate_command(folder: JobFolder, mode: str, config: dict, prompts_path: str, checkpoint: Optional[str],
                     steps: Optional[int], width: Optional[int], height: Optional[int], seed: Optional[int]) -> list[str]:
    """The tools/generate.py command: a LoRA job's base model with `checkpoint` as its network (a textual-inversion
    job: as its embedding; a fine-tune job: `checkpoint` is the model), the job's other model files, the prompt file, into output/sample/."""
    base = _first(config, "pretrained_model_name_or_path")
    argv = [sys.executable, os.path.join("tools", "generate.py")]
    if mode == "lora":
        argv += ["--ckpt", str(base), "--network_module", str(_first(config, "network_module") or "networks.lora"),
                 "--network_weights", checkpoint]
    elif mode == "textual_inversion":  # the base model with the embedding; prompts write its token
        argv += ["--ckpt", str(base)] + (["--textual_inversion_embeddings", checkpoint] if checkpoint else [])
    elif mode == "controlnet_lllite":  # a network too; each prompt needs its control image (--cn)
        argv += ["--ckpt", str(base), "--lllite", checkpoint]
    else:
        argv += ["--ckpt", checkpoint or str(base)]
    for key in GENERATE_FILE_KEYS:
        value = _first(config, key)
        if isinstance(value, str) and value:
            argv += [f"--{key}", value]
    argv += ["--outdir", os.path.join(folder.output_dir, GENERATE_DIR), "--from_file", prompts_path]
    for flag, value in (("--steps", steps), ("--W", width), ("--H", height), ("--seed", seed)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


class Generations:
    """Background tool runs (test generation per job; captioning per folder): at most one per key at a time; its
    state (running / finished / failed, the command, the last lines of its log) for the page to poll."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state: dict[int, dict[str, Any]] = {}

    def state(self, job_id: int) -> dict[str, Any]:
        with self._lock:
            return dict(self._state.get(job_id) or {"status": "idle"})

    def start(self, job_id, log_path: str, argv: list[str]) -> Optional[dict[str, Any]]:
        """Start `argv` in the background, its output appended to `log_path`; None when one is already running
        for the key (a job id, or a captioned folder)."""
        with self._lock:
            if (self._state.get(job_id) or {}).get("status") == "running":
                return None
            with open_for_append(log_path) as log:
                log.write(("$ " + " ".join(argv) + "\n").encode())
                log.flush()
                child = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO_ROOT})
            state = {"status": "running", "pid": child.pid, "command": argv, "started": time.time(), "exit_code": None}
            self._state[job_id] = state
        threading.Thread(target=self._wait, args=(job_id, child, log_path), daemon=True).start()
        return dict(state)

    def _wait(self, job_id: int, child: subprocess.Popen, log_path: str) -> None:
        code = child.wait()
        try:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                tail = f.read()[-2000:]
        except OSError:
            tail = ""
        with self._lock:
            state = self._state.get(job_id)
            if state is not None and state.get("pid") == child.pid:
                state.update(status="finished" if code == 0 else "failed", exit_code=code, ended=time.time(),
                             log_tail=tail)

    def wait(self, job_id: int, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.state(job_id)["status"] == "running":
            time.sleep(0.2)
        return self.state(job_id)["status"]
