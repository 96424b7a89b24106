"""Shared pieces of the step benchmarks: timing, interleaved comparison, peak memory."""

from __future__ import annotations

import resource
import time
from typing import Callable

import torch


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn: Callable[[], None], steps: int, warmup: int) -> float:
    """Seconds per call of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def compare_steps(reference: Callable[[], None], ours: Callable[[], None], steps: int, warmup: int) -> tuple[float, float]:
    """(reference, ours) seconds per step; interleaved in two rounds, best of each, to spread machine noise."""
    ref_times, our_times = [], []
    for _ in range(2):
        ref_times.append(timed(reference, steps // 2 or 1, warmup))
        our_times.append(timed(ours, steps // 2 or 1, warmup))
    return min(ref_times), min(our_times)


def print_comparison(ref: float, ours: float) -> None:
    print(f"reference (bare diffusers) step: {ref:.3f} s")
    print(f"our trainer step:               {ours:.3f} s")
    print(f"ratio ours/reference:           {ours / ref:.3f}  (goal <= 1.10)")
    print(f"peak RSS:                       {peak_rss_mib():.0f} MiB")
    if torch.cuda.is_available():
        print(f"peak VRAM:                      {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
