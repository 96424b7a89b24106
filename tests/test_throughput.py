"""--log_tflops: FLOPs counted on the first step, TFLOP/s reported every N steps."""

from __future__ import annotations

import logging

import pytest
import torch

from library.train.observe.throughput import ThroughputMeter, bf16_peak_tflops
from tests.train_helpers import base_args, make_dataset, make_trainer


def test_meter_counts_forward_and_backward_of_the_first_step_only():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    meter = ThroughputMeter(every=2, device=torch.device("cpu"))
    for step in (1, 2, 3):
        meter.shape(tuple(x.shape), 3)
        with meter.count("forward"):
            loss = layer(x).sum()
        with meter.count("backward"):
            loss.backward()
        meter.micro_step_done()
        report = meter.step_done(step)
        assert (report is None) == (step != 2)
    mm = 2 * 3 * 8 * 4  # one (3x8)@(8x4) matmul
    assert (meter.forward_flops, meter.backward_flops, meter.step_flops) == (mm, 2 * mm, 3 * mm)
    assert report is None and meter._steps == 1
    assert bf16_peak_tflops(torch.device("cpu")) is None


def test_each_batch_shape_is_counted_once_and_weighs_its_steps():
    """Two buckets whose micro-steps cost 1x and 4x: each shape is counted the first time it comes, those steps
    are not timed, and the report's FLOPs are those of the steps it times."""
    layer = torch.nn.Linear(8, 8)
    meter = ThroughputMeter(every=1, device=torch.device("cpu"))
    clock = iter([0.0, 10.0, 11.0, 12.0]).__next__  # the ends of steps 1..4
    meter._now = clock
    reports = []
    for step, rows in enumerate([1, 4, 1, 4], start=1):  # step 1: new shape; 2: new shape; 3, 4: known
        x = torch.randn(rows, 8, requires_grad=True)
        meter.shape(tuple(x.shape), rows)
        with meter.count("forward"):
            loss = layer(x).sum()
        with meter.count("backward"):
            loss.backward()
        meter.micro_step_done()
        reports.append(meter.step_done(step))
    one = 3 * 2 * 8 * 8  # forward + weight and input gradients of one row
    assert meter.flops_by_shape == {(1, 8): (one // 3, 2 * one // 3), (4, 8): (4 * one // 3, 8 * one // 3)}
    assert reports[:2] == [None, None]  # counted steps are not timed
    assert reports[2].tflops * 1e12 == pytest.approx(one / 1.0) and reports[2].images_per_second == 1.0
    assert reports[3].tflops * 1e12 == pytest.approx(4 * one / 1.0) and reports[3].images_per_second == 4.0


def test_selective_checkpointing_saved_operators_are_not_subtracted_as_recompute():
    """Under --gradient_checkpointing_policy matmul the matrix products are saved, not rerun in backward: the meter
    subtracts no recompute, so the model FLOPs equal the uncheckpointed block's. Under `full` backward reruns the
    first product (torch stops recomputing once the tensors backward needs exist, so the last one is not rerun)."""
    from library.train.memory.checkpoint_policy import SAVED_OPS, selective_checkpoint

    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8, requires_grad=True)
    mm1, mm2 = 2 * 3 * 8 * 16, 2 * 3 * 16 * 4
    fwd = mm1 + mm2

    def model_flops(checkpoint, saved_ops):
        meter = ThroughputMeter(every=1, device=torch.device("cpu"), gradient_checkpointing=checkpoint is not None,
                                saved_ops=saved_ops)
        meter.shape(tuple(x.shape), 3)
        with meter.count("forward"):
            loss = (checkpoint(block, x) if checkpoint else block(x)).sum()
        with meter.count("backward"):
            loss.backward()
        return meter.forward_flops, meter.backward_flops, meter.step_flops

    def full(module, inputs):
        return torch.utils.checkpoint.checkpoint(module, inputs, use_reentrant=False)

    assert model_flops(None, frozenset()) == (fwd, 2 * fwd, 3 * fwd)
    assert model_flops(full, frozenset())[:2] == (fwd, 2 * fwd + mm1)
    # the matmul policy keeps both products: backward reruns neither, and nothing is subtracted
    assert model_flops(selective_checkpoint("matmul"), SAVED_OPS["matmul"]) == (fwd, 2 * fwd, 3 * fwd)


def _flux_meter(tmp_path, *extra):
    data = make_dataset(str(tmp_path), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:flux", steps=3, extra=[
        "--t5xxl_max_token_length", "8", "--network_train_unet_only", "--cache_latents",
        "--cache_text_encoder_outputs", "--log_tflops", "1", *extra]), "flux")
    trainer.run()
    return trainer.instruments.meter


def test_training_logs_tflops_and_checkpointing_recompute_is_not_counted(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="library.train.trainer"):
        plain = _flux_meter(tmp_path / "a")
    lines = [r.getMessage() for r in caplog.records if "model TFLOP/s" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 3"]  # step 1 is the counted one
    checkpointed = _flux_meter(tmp_path / "b", "--gradient_checkpointing")
    assert plain.forward_flops == checkpointed.forward_flops > 0
    # LoRA on a frozen base: backward is about one forward (input gradients) plus the small LoRA weight grads.
    assert 1.0 < plain.backward_flops / plain.forward_flops < 1.2
    # Checkpointing re-runs the forward in backward; the meter subtracts it (to within the un-checkpointed embedders).
    assert checkpointed.backward_flops > 1.9 * plain.forward_flops
    assert abs(checkpointed.step_flops / plain.step_flops - 1) < 0.05


def test_time_spent_sampling_or_saving_is_not_step_time():
    meter = ThroughputMeter(every=2, device=torch.device("cpu"))
    meter._now = iter([0.0, 1.0, 3.0, 4.0]).__next__  # step 1 ends at 0; 1..3 sampling; step 2 ends at 4
    meter.flops_by_shape[()] = (10**12, 0)
    meter._counted_this_step = True
    assert meter.step_done(1) is None  # the counted step: the clock starts when it ends
    with meter.paused():
        pass
    meter.micro_step_done()
    report = meter.step_done(2)
    assert (report.step_seconds, report.tflops) == (2.0, 0.5)
