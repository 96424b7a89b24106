"""Achieved model TFLOP/s of training steps (`--log_tflops N`).

The FLOPs of one optimizer step are counted once, on the first step, by
torch's FlopCounterMode (matmuls, convolutions and attention, as executed in
forward and backward). Under gradient checkpointing the backward also re-runs
the checkpointed forward; that recomputation is not model work, so the
forward count is subtracted once (the checkpointed blocks are nearly all of
the denoiser; the small embedders outside them make this a slight undercount).
Every N steps the mean wall time per step since the last report (less the
time spent sampling, saving and validating) turns the count into TFLOP/s and, on a GPU whose bf16 dense peak we know, a fraction of
that peak (model FLOPs utilisation).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

# bf16 dense tensor-core peaks (no sparsity), TFLOP/s, by a substring of torch.cuda.get_device_name().
BF16_PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
                    ("RTX 4090", 165.2), ("RTX 3090", 71.0))


def bf16_peak_tflops(device: torch.device) -> Optional[float]:
    """The bf16 dense peak of a known CUDA device, else None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


@dataclass
class ThroughputReport:
    step_seconds: float
    tflops: float
    mfu: Optional[float]  # fraction of the bf16 peak, when known

    def as_scalars(self) -> dict[str, float]:
        out = {"perf/step_seconds": self.step_seconds, "perf/model_tflops": self.tflops}
        if self.mfu is not None:
            out["perf/mfu"] = self.mfu
        return out

    def line(self) -> str:
        mfu = f", {self.mfu:.1%} of bf16 peak" if self.mfu is not None else ""
        return f"{self.step_seconds:.3f} s/step, {self.tflops:.3g} model TFLOP/s{mfu}"


class ThroughputMeter:
    """Counts the FLOPs of the first optimizer step, then reports TFLOP/s every `every` steps."""

    def __init__(self, every: int, device: torch.device, gradient_checkpointing: bool = False):
        self.every = every
        self.device = device
        self.gradient_checkpointing = gradient_checkpointing
        self.counting = True  # until the first optimizer step ends
        self.forward_flops = 0
        self.backward_flops = 0
        self._since: Optional[float] = None
        self._steps = 0
        self._paused = 0.0  # seconds of non-training work (sampling, saving, validation) since the last report

    @property
    def step_flops(self) -> int:
        """Model FLOPs of one optimizer step (all of its micro-steps)."""
        if self.gradient_checkpointing:
            return self.forward_flops + max(0, self.backward_flops - self.forward_flops)
        return self.forward_flops + self.backward_flops

    @contextlib.contextmanager
    def count(self, phase: str) -> Iterator[None]:
        """Count the FLOPs run inside as "forward" or "backward" (only during the first step)."""
        if not self.counting:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield
        if phase == "forward":
            self.forward_flops += counter.get_total_flops()
        else:
            self.backward_flops += counter.get_total_flops()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work inside (sampling, saving, validation) does not count as step time."""
        start = self._now()
        try:
            yield
        finally:
            self._paused += self._now() - start

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step_done(self, step: int) -> Optional[ThroughputReport]:
        """Call after each optimizer step; a report every `every` steps (timing starts after the counted step)."""
        if self.counting:  # the counted step runs slowly under the counter: start the clock after it
            self.counting = False
            self._since, self._steps, self._paused = self._now(), 0, 0.0
            return None
        self._steps += 1
        if step % self.every or not self._steps:
            return None
        now = self._now()
        seconds = (now - self._since - self._paused) / self._steps
        self._since, self._steps, self._paused = now, 0, 0.0
        tflops = self.step_flops / seconds / 1e12
        peak = bf16_peak_tflops(self.device)
        return ThroughputReport(seconds, tflops, tflops / peak if peak else None)
