"""What --profile_steps costs: the timer's own time per step, and a tiny training run with and without it.

    python bench/bench_profile.py [--steps 40]

1. The StepProfiler around empty phases (a data wait, forward, backward, optimizer and the end of the step),
   many times: its cost per step in microseconds (CPU: perf_counter marks).
2. tiny:sd1 LoRA training, alternating runs with and without --profile_steps: median seconds per step of
   each and their ratio. A tiny step is ~10 ms of mostly Python, so this ratio is an upper bound of the
   overhead on a real model (a full-size SD1.5 step is seconds on a CPU, ~0.1 s on an H100).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.train.observe.profiling import StepProfiler  # noqa: E402


def timer_cost_us(n: int = 20000) -> float:
    prof = StepProfiler(torch.device("cpu"), microbatches=True)
    start = time.perf_counter()
    for step in range(n):
        for _ in prof.timed([0]):
            with prof.phase("forward"):
                pass
            with prof.phase("backward"):
                pass
        with prof.phase("optimizer"):
            pass
        prof.step_done(step)
    return (time.perf_counter() - start) / n * 1e6


def run_seconds_per_step(tmp: str, steps: int, profile: bool, tag: str) -> float:
    from tests.train_helpers import base_args, make_dataset, make_trainer

    data = make_dataset(os.path.join(tmp, "data"), n=4)
    extra = ["--profile_steps"] if profile else []
    trainer = make_trainer(base_args(data, os.path.join(tmp, tag), steps=steps, extra=extra + ["--cache_latents"]))
    times: list[float] = []
    original = trainer._optimizer_step

    def timed_step(step: int) -> None:  # process CPU time between optimizer steps = one whole step (steadier
        original(step)                  # than wall time on a shared machine; the run is single-threaded)
        times.append(time.process_time())

    trainer._optimizer_step = timed_step
    trainer.run()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps[3:])  # after warm-up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    cost = timer_cost_us()
    print(f"StepProfiler cost: {cost:.1f} us per step (4 phases + data wait + step end, CPU)")
    with_p, without = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # alternate, so load on the machine hits both alike
            without.append(run_seconds_per_step(tmp, args.steps, False, f"off{r}"))
            with_p.append(run_seconds_per_step(tmp, args.steps, True, f"on{r}"))
    a, b = statistics.median(without), statistics.median(with_p)
    print(f"tiny:sd1 step (CPU time): {a * 1000:.2f} ms without, {b * 1000:.2f} ms with --profile_steps; "
          f"ratio {b / a:.3f}")
    print(f"on a 3.3 s full-size SD1.5 CPU step the timer is {cost / 3.3e6:.2e} of the step")


if __name__ == "__main__":
    main()
