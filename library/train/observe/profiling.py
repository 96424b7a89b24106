"""Per-step timing breakdown (`--profile_steps`, `--profile_microbatches`) and torch.profiler traces
(`--profiler_trace_dir`, `--profiler_trace_steps A-B`).

A step's wall time is split into: waiting for the batch (data), forward, backward, optimizer (clip, step,
schedule, zero) and the rest (Python between phases, logging, progress). With several processes the gradient
all-reduce runs inside backward (DDP overlaps it with the gradients still being computed); its own duration,
from a bucket's launch to its completion summed over buckets, is reported beside as "all-reduce (overlapped)".

On a GPU every phase is timed with CUDA events (recorded on the stream, read once at the end of the step, so
timing does not serialise the work); on the CPU with `perf_counter`, where the work is synchronous. Sampling,
saving and validation are not step time. The cost of profiling itself is measured by bench/bench_profile.py
(docs/performance.md).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from library.train.observe.throughput import ThroughputMeter, ThroughputReport

PHASES = ("data", "forward", "backward", "optimizer")


class _Clock:
    """Marks on the device's timeline: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class StepTimes:
    step: int
    total: float
    phases: dict[str, float]
    allreduce: Optional[float]  # seconds of all-reduce inside backward (None with one process)
    microbatches: list[tuple[float, float]] = field(default_factory=list)  # (forward, backward) each

    @property
    def other(self) -> float:
        return max(0.0, self.total - sum(self.phases.values()))

    def line(self) -> str:
        parts = " + ".join(f"{name} {self.phases.get(name, 0.0):.3f}" for name in PHASES)
        comm = f" (all-reduce {self.allreduce:.3f} overlapped with backward)" if self.allreduce is not None else ""
        micro = ""
        if len(self.microbatches) > 1 or (self.microbatches and self.microbatches[0] != (0.0, 0.0)):
            micro = "; micro-batches " + ", ".join(f"{f:.3f}/{b:.3f}" for f, b in self.microbatches)
        return f"step {self.step}: {self.total:.3f} s = {parts} + other {self.other:.3f}{comm}{micro}"

    def scalars(self) -> dict[str, float]:
        out = {f"profile/{name}_seconds": self.phases.get(name, 0.0) for name in PHASES}
        out["profile/other_seconds"] = self.other
        out["profile/step_seconds"] = self.total
        if self.allreduce is not None:
            out["profile/allreduce_seconds"] = self.allreduce
        return out


class StepProfiler:
    """Times the phases of every optimizer step. Use: `timed(loader)` for the data wait, `phase(name)` around
    forward / backward / optimizer, `paused()` around non-step work, `step_done(step)` after each step."""

    def __init__(self, device: torch.device, microbatches: bool = False):
        self.clock = _Clock(device)
        self.microbatches = microbatches
        self._marks: list[tuple[str, object, object]] = []  # (phase, start, end) of the current step
        self._start = None
        self._paused = 0.0
        self._allreduce: list[float] = []
        self._ranks = 1

    def _begin_if_needed(self) -> None:
        if self._start is None:
            self._start = self.clock.mark()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._begin_if_needed()
        start = self.clock.mark()
        try:
            yield
        finally:
            self._marks.append((name, start, self.clock.mark()))

    def timed(self, iterable):
        """Yields from `iterable`, timing each wait for the next item as "data"."""
        it = iter(iterable)
        while True:
            self._begin_if_needed()
            start = self.clock.mark()
            try:
                item = next(it)
            except StopIteration:  # the end of an epoch is not a wait for this step's data
                if not self._marks:
                    self._start = None
                return
            self._marks.append(("data", start, self.clock.mark()))
            yield item

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.clock.settle()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.clock.settle()
            self._paused += time.perf_counter() - start

    def watch_allreduce(self, ddp_module) -> None:
        """Time DDP's bucket all-reduces: the default hook, with the time from launch to completion recorded."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._ranks = dist.get_world_size()
        durations = self._allreduce

        def timed_allreduce(state, bucket):
            start = time.perf_counter()

            def done(fut):
                durations.append(time.perf_counter() - start)
                return fut.value()[0] if isinstance(fut.value(), list) else fut.value()

            return allreduce_hook(state, bucket).then(done)

        ddp_module.register_comm_hook(None, timed_allreduce)

    def step_done(self, step: int) -> Optional[StepTimes]:
        if self._start is None:
            return None
        end = self.clock.mark()
        self.clock.settle()
        phases: dict[str, float] = {}
        micro: list[list[float]] = []
        for name, start, stop in self._marks:
            seconds = self.clock.seconds(start, stop)
            phases[name] = phases.get(name, 0.0) + seconds
            if name == "forward":
                micro.append([seconds, 0.0])
            elif name == "backward" and micro:
                micro[-1][1] += seconds
        total = self.clock.seconds(self._start, end) - self._paused
        allreduce = sum(self._allreduce) if self._ranks > 1 else None
        times = StepTimes(step, total, phases, allreduce,
                          [(f, b) for f, b in micro] if self.microbatches else [])
        self._marks, self._start, self._paused = [], None, 0.0
        self._allreduce.clear()
        return times


def parse_step_range(text: str) -> tuple[int, int]:
    """'A-B' (1-based optimizer steps, inclusive) -> (A, B); ValueError with what was expected."""
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"expected A-B with whole numbers, e.g. 5-8; got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"expected 1 <= A <= B, got {text!r}")
    return a, b


class TraceWindow:
    """torch.profiler over optimizer steps A..B, written for TensorBoard / Perfetto into `folder`."""

    def __init__(self, folder: str, first: int, last: int, device: torch.device):
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        self.first, self.last = first, last
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile = profile(activities=activities, record_shapes=True, with_stack=False,
                                on_trace_ready=tensorboard_trace_handler(folder))
        self._active = False

    def before_step(self, step: int) -> None:
        """`step`: the optimizer step about to run (1-based)."""
        if step == self.first and not self._active:
            self._profile.__enter__()
            self._active = True

    def after_step(self, step: int) -> None:
        if self._active and step >= self.last:
            self.close()

    def close(self) -> None:
        if self._active:
            self._profile.__exit__(None, None, None)
            self._active = False


class Instruments:
    """What the loop measures, in one place: FLOP counting and TFLOP/s (`--log_tflops`), the timing breakdown
    (`--profile_steps`) and the torch.profiler window (`--profiler_trace_dir`); each part optional."""

    def __init__(self, meter: Optional[ThroughputMeter], profiler: Optional[StepProfiler],
                 trace: Optional[TraceWindow]):
        self.meter, self.profiler, self.trace = meter, profiler, trace

    @staticmethod
    def for_run(t, device: torch.device, ddp_module=None, main_process: bool = True,
                checkpoint_saved_ops: frozenset = frozenset()) -> Instruments:
        """What the TrainingOptions `t` ask for (--log_tflops, --profile_steps, --profiler_trace_dir); the DDP
        module, when there is one, has its all-reduces timed; `checkpoint_saved_ops`: the operators a selective
        checkpoint policy keeps (their forward is not rerun in backward)."""
        meter = (ThroughputMeter(t.log_tflops, device, t.gradient_checkpointing, checkpoint_saved_ops)
                 if t.log_tflops else None)
        profiler = StepProfiler(device, t.profile_microbatches) if t.profile_steps else None
        if profiler is not None and ddp_module is not None:
            profiler.watch_allreduce(ddp_module)
        trace = None
        if t.profiler_trace_dir and main_process:
            trace = TraceWindow(t.profiler_trace_dir, *t.profiler_trace_steps, device)
        return Instruments(meter, profiler, trace)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.meter is not None and name in ("forward", "backward"):
                stack.enter_context(self.meter.count(name))
            if self.profiler is not None:
                stack.enter_context(self.profiler.phase(name))
            yield

    def micro_batch(self, shape: tuple, images: int) -> None:
        """Before a micro-step's forward: its batch shape and the images all processes train in it."""
        if self.meter is not None:
            self.meter.shape(shape, images)

    def micro_done(self) -> None:
        if self.meter is not None:
            self.meter.micro_step_done()

    def timed(self, loader):
        return self.profiler.timed(loader) if self.profiler is not None else loader

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Sampling, saving and validation are not step time."""
        with contextlib.ExitStack() as stack:
            if self.meter is not None:
                stack.enter_context(self.meter.paused())
            if self.profiler is not None:
                stack.enter_context(self.profiler.paused())
            yield

    def before_step(self, step: int) -> None:
        if self.trace is not None:
            self.trace.before_step(step)

    def step_done(self, step: int) -> tuple[Optional[ThroughputReport], Optional[StepTimes]]:
        if self.trace is not None:
            self.trace.after_step(step)
        report = self.meter.step_done(step) if self.meter is not None else None
        times = self.profiler.step_done(step) if self.profiler is not None else None
        return report, times

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
