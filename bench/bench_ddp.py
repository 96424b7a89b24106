"""Images per second with 1 and 2 CPU processes (torchrun, gloo) on tiny:sd1, and the weights-equal check.

    python bench/bench_ddp.py [--steps 40] [--warmup 5]

Each process runs with one intra-op thread (OMP_NUM_THREADS=1), so 2 processes use 2 cores and the ideal
speed-up is 2.0. Throughput comes from the per-step trace (library/train/distributed/distributed.py TRACE_ENV): images
trained by all processes between the end of the warm-up step and the last step, over that wall time. The same
trace holds a hash of every process's trained weights after every step: they must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp: str, processes: int, steps: int) -> list[list[dict]]:
    from tests.train_helpers import base_args, make_dataset

    data = make_dataset(os.path.join(tmp, "data"), n=8)
    trace = os.path.join(tmp, f"trace{processes}")
    argv = base_args(data, os.path.join(tmp, f"out{processes}"), steps=steps,
                     extra=["--cpu", "--cache_latents", "--network_train_unet_only"])
    env = dict(os.environ, OMP_NUM_THREADS="1", SDTRAIN_DISTRIBUTED_TRACE=trace, LOGLEVEL="WARNING",
               PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    cmd = [shutil.which("torchrun") or "torchrun", "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(REPO, "train_network.py"), *argv]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun with {processes} process(es) failed:\n{proc.stderr[-3000:]}")
    out = []
    for rank in range(processes):
        with open(os.path.join(trace, f"rank{rank}.jsonl"), encoding="utf-8") as f:
            out.append([json.loads(line) for line in f])
    return out


def images_per_second(traces: list[list[dict]], warmup: int) -> float:
    images = sum(len(t["images"]) for rank in traces for t in rank[warmup:])
    start = max(rank[warmup - 1]["time"] for rank in traces)
    end = max(rank[-1]["time"] for rank in traces)
    return images / (end - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the 1-process run (half with 2)")
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = run(tmp, 1, args.steps)
        two = run(tmp, 2, args.steps // 2 + args.warmup)
    a, b = images_per_second(one, args.warmup), images_per_second(two, args.warmup)
    equal = all(x["params"] == y["params"] for x, y in zip(two[0], two[1])) and len(two[0]) == len(two[1])
    print(f"tiny:sd1 LoRA, batch 1 per process, 1 thread per process: 1 process {a:.2f} images/s, "
          f"2 processes {b:.2f} images/s, speed-up {b / a:.2f} (ideal 2.0)")
    print(f"2 processes: trained weights equal on both after every one of {len(two[0])} steps: {equal}")


if __name__ == "__main__":
    main()
