"""Achieved model TFLOP/s and images/s of training steps (`--log_tflops N`).

The FLOPs of a micro-step are counted by torch's FlopCounterMode (matmuls, convolutions and attention, as
executed in forward and backward) once per batch shape: on the first step, and again the first time a batch of
another bucket shape comes (a multi-resolution run mixes shapes whose costs differ several-fold). Under gradient
checkpointing the backward also re-runs the checkpointed forward; that recomputation is not model work, so the
forward count is subtracted once (the checkpointed blocks are nearly all of the denoiser; the small embedders
outside them make this a slight undercount). Under a selective policy (--gradient_checkpointing_policy) the
operators it saves are not rerun, so their forward FLOPs are left out of what is subtracted. Every N steps the FLOPs and images of the steps since the last
report, over their wall time (less the time spent sampling, saving and validating, and leaving out steps that
ran under the counter), give TFLOP/s, images/s and, on a GPU whose bf16 dense peak we know, the fraction of that
peak (model FLOPs utilisation).
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
    images_per_second: float = 0.0  # of all processes together

    def as_scalars(self) -> dict[str, float]:
        out = {"perf/step_seconds": self.step_seconds, "perf/model_tflops": self.tflops,
               "perf/images_per_second": self.images_per_second}
        if self.mfu is not None:
            out["perf/mfu"] = self.mfu
        return out

    def line(self) -> str:
        mfu = f", {self.mfu:.1%} of bf16 peak" if self.mfu is not None else ""
        return (f"{self.step_seconds:.3f} s/step, {self.images_per_second:.3g} images/s, "
                f"{self.tflops:.3g} model TFLOP/s{mfu}")


class ThroughputMeter:
    """Counts the FLOPs of a micro-step once per batch shape (the first step, and the first step of each new
    bucket shape), then reports TFLOP/s and images/s every `every` steps.

    `shape(key, images)` names each micro-batch before its forward (key: the batch's latent shape; images: how
    many images all processes train in it). Steps that count run slowly under the counter and are left out of
    the timing.
    """

    def __init__(self, every: int, device: torch.device, gradient_checkpointing: bool = False,
                 saved_ops: frozenset = frozenset()):
        self.every = every
        self.device = device
        self.gradient_checkpointing = gradient_checkpointing
        # operators a selective checkpoint policy keeps (not rerun in backward), as FlopCounterMode keys them
        self.saved_packets = frozenset(getattr(op, "overloadpacket", op) for op in saved_ops)
        self.flops_by_shape: dict[tuple, tuple[int, int]] = {}  # key -> (forward, backward) FLOPs of a micro-step
        self._saved_forward: dict[tuple, int] = {}  # key -> forward FLOPs of the saved operators
        self._key: tuple = ()
        self._images = 0
        self._counting_key: Optional[tuple] = None  # the shape being counted in this micro-step
        self._counted_this_step = False
        self._step_flops = 0  # FLOPs of the micro-steps of the current step
        self._window_flops = 0
        self._window_images = 0
        self._since: Optional[float] = None
        self._steps = 0
        self._paused = 0.0  # seconds of non-training work (sampling, saving, validation) since the last report

    @property
    def forward_flops(self) -> int:
        """Forward FLOPs of the first counted micro-step shape (what a one-shape run does per micro-step)."""
        return next(iter(self.flops_by_shape.values()), (0, 0))[0]

    @property
    def backward_flops(self) -> int:
        return next(iter(self.flops_by_shape.values()), (0, 0))[1]

    @property
    def step_flops(self) -> int:
        """Model FLOPs of one micro-step of the first counted shape."""
        return self._model_flops(self.forward_flops, self.backward_flops, next(iter(self._saved_forward.values()), 0))

    def _model_flops(self, forward: int, backward: int, saved_forward: int = 0) -> int:
        if self.gradient_checkpointing:  # the recomputed forward inside backward is not model work
            return forward + max(0, backward - (forward - saved_forward))
        return forward + backward

    def shape(self, key: tuple, images: int) -> None:
        self._key, self._images = key, images

    @contextlib.contextmanager
    def count(self, phase: str) -> Iterator[None]:
        """Count the FLOPs run inside as "forward" or "backward" when this micro-step's shape is new."""
        key = self._key
        if key in self.flops_by_shape and self._counting_key != key:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield
        fwd, bwd = self.flops_by_shape.get(key, (0, 0))
        if phase == "forward":
            self._counting_key = key
            self.flops_by_shape[key] = (counter.get_total_flops(), bwd)
            counts = counter.get_flop_counts().get("Global", {})
            self._saved_forward[key] = sum(v for op, v in counts.items() if op in self.saved_packets)
        else:
            self.flops_by_shape[key] = (fwd, counter.get_total_flops())
            self._counting_key = None
            self._counted_this_step = True

    def micro_step_done(self) -> None:
        """After each micro-step's backward: its FLOPs and images join the step's."""
        fwd, bwd = self.flops_by_shape.get(self._key, (0, 0))
        self._step_flops += self._model_flops(fwd, bwd, self._saved_forward.get(self._key, 0))
        self._window_images += self._images

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
        """Call after each optimizer step; a report every `every` steps of the steps timed since the last."""
        flops, self._step_flops = self._step_flops, 0
        if self._counted_this_step or self._since is None:  # ran under the counter: the clock starts after it
            self._counted_this_step = False
            self._since, self._steps, self._paused = self._now(), 0, 0.0
            self._window_flops = self._window_images = 0
            return None
        self._steps += 1
        self._window_flops += flops
        if step % self.every:
            return None
        now = self._now()
        elapsed = now - self._since - self._paused
        seconds = elapsed / self._steps
        tflops = self._window_flops / elapsed / 1e12
        images = self._window_images / elapsed
        self._since, self._steps, self._paused = now, 0, 0.0
        self._window_flops = self._window_images = 0
        peak = bf16_peak_tflops(self.device)
        return ThroughputReport(seconds, tflops, tflops / peak if peak else None, images)
