"""What a run writes and when (library/train/saving.py RunSaver), with a one-tensor fake trainable: cadence,
retention, the final save, resume, and no file written when a tensor is not finite."""

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.train.optim.ema import EmaOptions
from library.train.saving import NonFiniteWeights, RunSaver, resume
from library.train.settings import TrainingOptions
from library.train.state import RunState, TrainProgress


class OneTensor:
    """The parts of a Trainable the saver calls."""

    is_adapter = True

    def __init__(self):
        self.w = torch.nn.Parameter(torch.ones(2, 2))

    def file_path(self, output_dir, stem):
        return os.path.join(output_dir, stem + ".safetensors")

    def weights(self):
        return {"w": self.w}

    def full_shapes(self):
        return {"w": tuple(self.w.shape)}

    def gathered(self, main):
        return contextlib.nullcontext()

    def save(self, path, metadata):
        save_file({"w": self.w.detach().clone()}, path, metadata={k: str(v) for k, v in metadata.items()})

    def state_for_saving(self, optimizer):
        return self.weights(), optimizer.state_dict()

    def shape_settings(self):
        return {"network_dim": 2}

    def restore(self, weights, optimizer, optimizer_state):
        with torch.no_grad():
            self.w.copy_(weights["w"])
        optimizer.load_state_dict(optimizer_state)


def make_saver(tmp_path, max_steps=7, seed=3, **flags):
    t = TrainingOptions(output_dir=str(tmp_path), output_name="run", **flags)
    trainable = OneTensor()
    opt = torch.optim.SGD([trainable.w], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    run = RunState.start(seed)
    accelerator = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), wait_for_everyone=lambda: None)
    saver = RunSaver(t, EmaOptions(), trainable, None, opt, "SGD", sched, run, accelerator, None,
                     lambda step, epoch: {"ss_steps": step, "ss_epoch": epoch}, 2, max_steps)
    return saver, trainable, opt, sched, run


def test_step_saves_keep_the_last_n_and_the_final_file_is_the_output_name(tmp_path):
    saver, _, _, _, run = make_saver(tmp_path, save_every_n_steps=2, save_last_n_steps=2, save_state=True)
    for step in range(1, 8):
        run.advance(1, step, step)
        saver.after_step(step)
    assert sorted(os.listdir(tmp_path)) == ["run-step00000004-state", "run-step00000004.safetensors",
                                           "run-step00000006-state", "run-step00000006.safetensors"]
    assert load_file(str(tmp_path / "run-step00000006.safetensors")).keys() == {"w"}
    assert saver.final(TrainProgress(epoch=2, global_step=7, batches_done=0)) == str(tmp_path / "run.safetensors")
    assert {"run.safetensors", "run-state"} <= set(os.listdir(tmp_path))


def test_epoch_saves_skip_the_last_epoch(tmp_path):
    saver, *_ = make_saver(tmp_path, save_every_n_epochs=1)
    saver.after_epoch(1, 3)
    saver.after_epoch(2, 6)  # the last of 2 epochs: only the final file, as in sd-scripts
    assert sorted(os.listdir(tmp_path)) == ["run-000001.safetensors"]


def test_a_non_finite_weight_is_refused_and_nothing_is_written(tmp_path):
    saver, trainable, *_ = make_saver(tmp_path, save_every_n_steps=1, save_state=True)
    with torch.no_grad():
        trainable.w[1, 0] = float("nan")
    with pytest.raises(NonFiniteWeights, match=r"^step 1: w is not finite \(NaN or inf\); not saving "):
        saver.after_step(1)
    assert os.listdir(tmp_path) == []


def test_resume_restores_the_weights_progress_and_rngs_of_a_saved_state(tmp_path):
    saver, trainable, opt, sched, run = make_saver(tmp_path, save_every_n_steps=2, save_state=True)
    torch.randn(5, generator=run.noise_generator)  # the noise of steps 1 and 2
    run.advance(1, 2, 2)
    saver.after_step(2)
    next_noise = torch.randn(3, generator=run.noise_generator)
    _, other, other_opt, other_sched, other_run = make_saver(tmp_path, seed=4)
    with torch.no_grad():
        other.w.zero_()
    resume(str(tmp_path / "run-step00000002-state"), str(tmp_path), 7, other, other_opt, other_sched, None, None,
           other_run)
    assert torch.equal(other.w, trainable.w)
    assert other_run.progress == TrainProgress(epoch=1, global_step=2, batches_done=2)
    assert torch.equal(torch.randn(3, generator=other_run.noise_generator), next_noise)
