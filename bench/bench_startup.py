"""Time from the command to the first step, and peak RSS, of the quickstart (issue 28).

Runs `python train_network.py --config_file examples/quickstart_sd.toml --max_train_steps 2 --lr_warmup_steps 0`
(tiny SD 1.x, TensorBoard on, as scripts/quickstart.sh) in a fresh process, times it from the start of the
process to the progress bar's first finished step (tqdm's "1/2" on stderr), and reads the child's peak RSS
(wait4's ru_maxrss) and user + system CPU seconds. With --baseline DIR the same command runs from another
checkout (e.g. `git worktree add /tmp/base main`), the two alternating run by run; the minimum over the repeats of
each is compared (the steadiest figure on a shared machine: other load only ever adds time).

With --floor it measures instead what importing only the quickstart's model classes costs, in a fresh process:
torch; then a torch.optim optimizer (every run builds one: its constructor's `add_param_group`, wrapped in
`torch._disable_dynamo`, imports torch._dynamo with sympy and torch.distributed.tensor, torch's own floor under any
training process); then library.families (whose import installs deferred_backends.py's finder, keeping torchao,
scipy and boto3 out); then transformers' CLIP text model and tokenizer (the SD 1.x text encoder); then diffusers'
U-Net and VAE files through library/families/common/diffusers_import.py: peak RSS and CPU seconds after each, the
floor under any start-up of this run (the run adds its data, models, optimizer and the first step's kernels to it).
Imports run on one thread, so their CPU seconds are also a lower bound on their wall-clock time.
LORA_TOOLKIT_PLAIN_DIFFUSERS_IMPORT=1 in the environment measures the same imports without either deferral.

    python bench/bench_startup.py [--repeats 5] [--baseline /path/to/other/checkout] [--threads 1] [--floor]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(repo: str, threads: int, extra: list[str]) -> dict[str, float]:
    """One quickstart run from `repo`: first_step (s), total (s), cpu (s), peak_rss (MiB)."""
    out = tempfile.mkdtemp(prefix="bench_startup_")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "train_network.py", "--config_file", "examples/quickstart_sd.toml", "--max_train_steps",
           "2", "--lr_warmup_steps", "0", "--output_dir", out, "--logging_dir", os.path.join(out, "logs"), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first: Optional[float] = None
    tail = b""
    assert proc.stderr is not None
    while True:
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk:
            break
        tail = (tail + chunk)[-4000:]
        if first is None and b" 1/2 [" in tail:
            first = time.perf_counter() - t0
    _, status, usage = os.wait4(proc.pid, 0)
    total = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    if os.waitstatus_to_exitcode(status) != 0 or first is None:
        raise SystemExit(f"quickstart failed in {repo}:\n{tail.decode(errors='replace')}")
    return {"first_step": first, "total": total, "cpu": usage.ru_utime + usage.ru_stime,
            "peak_rss": usage.ru_maxrss / 1024}


_FLOOR = """
import resource, sys, time
c0 = time.process_time()
def report(what):
    print(f"{what:58s} peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:5.0f} MiB  "
          f"CPU {time.process_time() - c0:5.2f} s  modules {len(sys.modules)}", flush=True)
import torch
report("torch")
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # Optimizer.add_param_group is torch._disable_dynamo'd
report("+ a torch.optim optimizer (imports torch._dynamo, sympy)")
import library.families  # installs deferred_backends' finder, as every run does before its first model import
report("+ library.families")
from transformers.models.clip.modeling_clip import CLIPTextModel
from transformers.models.clip.tokenization_clip import CLIPTokenizer
report("+ transformers CLIPTextModel, CLIPTokenizer")
from library.families.common.diffusers_import import diffusers_classes
diffusers_classes("UNet2DConditionModel", "AutoencoderKL")
report("+ diffusers UNet2DConditionModel, AutoencoderKL (own files)")
"""


def floor(threads: int) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads), PYTHONDONTWRITEBYTECODE="1")
    subprocess.run([sys.executable, "-c", _FLOOR], cwd=HERE, env=env, check=True, stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", help="another checkout to run the same command from, alternating")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--floor", action="store_true", help="the import floor of the quickstart's models, in steps")
    a, extra = p.parse_known_args()
    if a.floor:
        for _ in range(a.repeats):
            floor(a.threads)
        return
    repos = {"ours": HERE}
    if a.baseline:
        repos = {"baseline": os.path.abspath(a.baseline), "ours": HERE}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in repos}
    for i in range(a.repeats):
        for name, repo in repos.items():
            r = run_once(repo, a.threads, extra)
            runs[name].append(r)
            print(f"run {i + 1} {name:8s} first step {r['first_step']:6.2f} s  cpu {r['cpu']:6.2f} s  "
                  f"peak RSS {r['peak_rss']:5.0f} MiB  load {os.getloadavg()[0]:.1f}", flush=True)
    best = {k: {m: min(r[m] for r in v) for m in ("first_step", "cpu", "peak_rss")} for k, v in runs.items()}
    for name, b in best.items():
        print(f"{name:8s} min first step {b['first_step']:6.2f} s  min cpu {b['cpu']:6.2f} s  "
              f"min peak RSS {b['peak_rss']:5.0f} MiB")
    if a.baseline:
        o, s = best["ours"], best["baseline"]
        print(f"ours/baseline: first step {o['first_step'] / s['first_step']:.2f}x (goal <= 0.50), "
              f"cpu {o['cpu'] / s['cpu']:.2f}x, peak RSS {o['peak_rss'] / s['peak_rss']:.2f}x "
              f"({o['peak_rss']:.0f} MiB, goal <= 400)")


if __name__ == "__main__":
    main()
