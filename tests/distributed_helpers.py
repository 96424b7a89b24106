"""Helpers of the tests that launch training processes (torchrun, accelerate launch): a tiny dataset, the
training flags, a torchrun launch of 2 processes with an audit of the files each writes, their step traces,
and tools/make_accelerate_config.py's files with the arguments accelerate's launcher reads from them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = shutil.which("torchrun")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")

WORKER = r'''
import atexit, os, runpy, sys
roots = tuple(os.path.realpath(r) for r in os.environ["AUDIT_ROOTS"].split(os.pathsep))
seen = []
def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        paths = [path] if writing else []
    elif event in ("os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "shutil.copyfile"):
        paths = list(args[:2]) if event == "os.rename" else [args[0]]
    else:
        return
    for p in paths:
        if isinstance(p, (str, bytes, os.PathLike)):
            p = os.path.realpath(os.fsdecode(p))
            if p.startswith(roots):
                seen.append(event + " " + p)
def dump():
    with open(os.path.join(os.environ["AUDIT_DIR"], "writes%s.txt" % os.environ["RANK"]), "w") as f:
        f.write("\n".join(seen))
atexit.register(dump)
sys.addaudithook(hook)
sys.argv = [os.path.join(os.environ["REPO"], os.environ.get("SCRIPT", "train_network.py"))] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dataset(root: str, n: int = 8) -> str:
    """n images, repeats 1, one 64x64 bucket: an epoch is n batches of 1, each image once."""
    folder = os.path.join(root, "train", "1_sks toy")
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        img = np.zeros((64, 64, 3), np.uint8) + np.uint8(i * 29)
        img[16:32, 16:32] = 255 - i * 29
        Image.fromarray(img).save(os.path.join(folder, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(f"sks toy, color {i}")
    return os.path.join(root, "train")


def train_args(data: str, out: str, logs: str, steps: int, extra=()) -> list[str]:
    return ["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir", data, "--caption_extension", ".txt",
            "--resolution", "64", "--train_batch_size", "1", "--max_data_loader_n_workers", "0",
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
            "--learning_rate", "1e-3", "--max_train_steps", str(steps), "--seed", "123", "--cpu",
            "--output_dir", out, "--output_name", "lora", "--logging_dir", logs, "--save_state", *extra]


def launch(tmp, nodes: int, argv: list[str], timeout: int = 150, trace: str = "trace", audit_roots=None,
           env_extra=None, nproc: int = 2) -> None:
    """torchrun with 2 processes in all: one node of 2 (or `nproc`) or two loopback nodes of 1; raises with the logs
    on failure."""
    worker = os.path.join(tmp, "worker.py")
    with open(worker, "w") as f:
        f.write(WORKER)
    audit = os.path.join(tmp, "audit")
    os.makedirs(audit, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, REPO=REPO, AUDIT_DIR=audit,
               AUDIT_ROOTS=os.pathsep.join(audit_roots or [os.path.join(tmp, "out"), os.path.join(tmp, "logs")]),
               SDTRAIN_DISTRIBUTED_TRACE=os.path.join(tmp, trace), LOGLEVEL="WARNING", **(env_extra or {}))
    port = free_port()
    if nodes == 1:
        commands = [[TORCHRUN, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(port)]]
    else:
        commands = [[TORCHRUN, "--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "1",
                     "--rdzv_endpoint", f"127.0.0.1:{port}"] for r in range(2)]
    procs = []
    for i, cmd in enumerate(commands):
        log = open(os.path.join(tmp, f"launch{i}.log"), "w")
        procs.append((subprocess.Popen(cmd + [worker] + argv, env=env, cwd=REPO, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            codes.append("timeout")
        log.close()
    if any(c != 0 for c in codes):
        logs = "\n".join(open(os.path.join(tmp, f"launch{i}.log")).read()[-3000:] for i in range(len(commands)))
        raise AssertionError(f"torchrun exited with {codes}:\n{logs}")


def read_trace(tmp, name: str = "trace") -> dict[int, list[dict]]:
    out = {}
    for rank in (0, 1):
        with open(os.path.join(tmp, name, f"rank{rank}.jsonl")) as f:
            out[rank] = [json.loads(line) for line in f]
    return out


TOOL = os.path.join(REPO, "tools", "make_accelerate_config.py")


def make_accelerate_config(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, str]:
    out = str(tmp_path / "accelerate.yaml")
    proc = subprocess.run([sys.executable, TOOL, *flags, "--output", out], capture_output=True, text=True, cwd=REPO)
    return proc, out


def launch_args(path: str):
    """The launch arguments `accelerate launch --config_file path train.py` works with (as launch_command)."""
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )

    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    return args
