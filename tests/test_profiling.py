"""--profile_steps / --profile_microbatches / --profiler_trace_dir: the per-step timing breakdown and the trace."""

from __future__ import annotations

import glob
import logging
import os
import time

import pytest
import torch

from library.core.errors import ConfigError
from library.train.observe.profiling import StepProfiler, parse_step_range
from tests.train_helpers import base_args, make_dataset, make_trainer


def test_breakdown_adds_up_and_splits_microbatches():
    prof = StepProfiler(torch.device("cpu"), microbatches=True)

    def slow_loader(n):
        for x in range(n):
            time.sleep(0.03)
            yield x

    sleeps = [(0.02, 0.05), (0.04, 0.07)]  # (forward, backward) of the two micro-batches
    for i in prof.timed(slow_loader(2)):
        with prof.phase("forward"):
            time.sleep(sleeps[i][0])
        with prof.phase("backward"):
            time.sleep(sleeps[i][1])
    with prof.phase("optimizer"):
        time.sleep(0.01)
    with prof.paused():  # saving / sampling: not step time
        time.sleep(0.2)
    times = prof.step_done(1)
    assert set(times.phases) == {"data", "forward", "backward", "optimizer"}
    assert times.phases["data"] >= 0.06 and times.phases["optimizer"] >= 0.01
    assert times.phases["forward"] >= 0.06 and times.phases["backward"] >= 0.12
    assert sum(times.phases.values()) <= times.total  # the phases lie inside the step...
    assert times.total < sum(times.phases.values()) + 0.1  # ...and the paused 0.2 s is not in it
    assert len(times.microbatches) == 2
    for (f, b), (sf, sb) in zip(times.microbatches, sleeps):
        assert sf <= f < sf + 0.15 and sb <= b < sb + 0.15
    line = times.line()
    assert line.startswith("step 1: ") and " forward " in line and "micro-batches" in line
    assert times.allreduce is None and "all-reduce" not in line  # one process
    assert set(times.scalars()) == {"profile/data_seconds", "profile/forward_seconds", "profile/backward_seconds",
                                    "profile/optimizer_seconds", "profile/other_seconds", "profile/step_seconds"}
    assert prof.step_done(2) is None  # nothing ran since


def test_step_range():
    assert parse_step_range("3-5") == (3, 5)
    for bad in ("5-3", "0-2", "3", "a-b"):
        with pytest.raises(ValueError):
            parse_step_range(bad)


def test_training_logs_the_breakdown_and_writes_a_trace(tmp_path, caplog):
    data = make_dataset(str(tmp_path), n=4)
    out, logs, trace = (str(tmp_path / x) for x in ("out", "logs", "trace"))
    argv = base_args(data, out, steps=3, extra=[
        "--profile_microbatches", "--gradient_accumulation_steps", "2", "--logging_dir", logs,
        "--profiler_trace_dir", trace, "--profiler_trace_steps", "2-2", "--network_train_unet_only"])
    with caplog.at_level(logging.INFO, logger="library.train.trainer"):
        make_trainer(argv).run()
    lines = [r.getMessage() for r in caplog.records if " s = data " in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "step 3"]
    assert all(line.count("/") >= 2 and "micro-batches" in line for line in lines)  # 2 micro-batches each
    # the trace of step 2, as TensorBoard's profiler plugin / Perfetto read it
    traces = glob.glob(os.path.join(trace, "*.pt.trace.json*"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_dir,) = {os.path.dirname(p) for p in glob.glob(os.path.join(logs, "**", "events.*"), recursive=True)}
    acc = EventAccumulator(event_dir)
    acc.Reload()
    forward = acc.Scalars("profile/forward_seconds")
    assert [e.step for e in forward] == [1, 2, 3] and all(e.value > 0 for e in forward)
    steps = acc.Scalars("profile/step_seconds")
    parts = [acc.Scalars(f"profile/{p}_seconds") for p in ("data", "forward", "backward", "optimizer", "other")]
    for i, step in enumerate(steps):
        assert sum(p[i].value for p in parts) == pytest.approx(step.value, rel=1e-4)


def test_bad_trace_steps_named(tmp_path):
    data = make_dataset(str(tmp_path), n=2)
    argv = base_args(data, str(tmp_path / "o"), steps=1, extra=["--profiler_trace_dir", str(tmp_path / "t"),
                                                                 "--profiler_trace_steps", "4-2"])
    with pytest.raises(ConfigError, match=r"--profiler_trace_steps: expected 1 <= A <= B, got '4-2'"):
        make_trainer(argv)
