"""Images per second of 2 CPU processes (torchrun, gloo) on tiny:sd1 LoRA: DDP against DeepSpeed ZeRO 1, 2 and 3.

    python bench/bench_deepspeed.py [--steps 20] [--warmup 4] [--stages 1,2,3]

The same run measures every variant (so the ratios to DDP compare like with like on a shared machine); one intra-op
thread per process. Throughput comes from the per-step trace (library/train/distributed/distributed.py TRACE_ENV), as in
bench/bench_ddp.py. A tiny model's step is milliseconds of compute, so this measures DeepSpeed's fixed per-step and
per-module costs, not what it saves on a large model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.bench_ddp import free_port, images_per_second  # noqa: E402


def run(tmp: str, name: str, steps: int, extra: list[str]) -> list[list[dict]]:
    from tests.train_helpers import base_args, make_dataset

    data = make_dataset(os.path.join(tmp, "data"), n=8)
    trace = os.path.join(tmp, f"trace-{name}")
    argv = base_args(data, os.path.join(tmp, f"out-{name}"), steps=steps,
                     extra=["--cpu", "--cache_latents", "--network_train_unet_only", *extra])
    env = dict(os.environ, OMP_NUM_THREADS="1", SDTRAIN_DISTRIBUTED_TRACE=trace, LOGLEVEL="WARNING",
               PYTHONPATH=REPO, HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")
    cmd = [shutil.which("torchrun") or "torchrun", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(REPO, "train_network.py"), *argv]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    out = []
    for rank in range(2):
        with open(os.path.join(trace, f"rank{rank}.jsonl"), encoding="utf-8") as f:
            out.append([json.loads(line) for line in f])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages to measure")
    args = p.parse_args()
    variants = [("DDP", [])] + [(f"ZeRO-{s}", ["--deepspeed", "--zero_stage", s]) for s in args.stages.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants:
            results[name] = images_per_second(run(tmp, name, args.steps, extra), args.warmup)
    ddp = results["DDP"]
    print(f"tiny:sd1 LoRA, 2 processes x batch 1, 1 thread each, {args.steps} steps ({args.warmup} warm-up):")
    for name, value in results.items():
        print(f"  {name:7s} {value:6.2f} images/s  ({value / ddp:.2f} x DDP)")


if __name__ == "__main__":
    main()
