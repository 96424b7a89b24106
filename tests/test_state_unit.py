"""A run's state folder alone (library/train/state.py): written, read back and restored, without a trainer."""

import json
import os
import random

import numpy as np
import pytest
import torch

from library.train.state import (DamagedState, RunState, TrainProgress, changed_flags, read_state, save_state,
                                 state_folders)


def small_run(tmp_path, step=5, flags=None):
    w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    opt = torch.optim.AdamW([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    w.grad = torch.ones_like(w)
    opt.step()
    sched.step()
    run = RunState.start(7, flags=flags or {"network_dim": 4})
    progress = TrainProgress(epoch=2, global_step=step, batches_done=1)
    path = str(tmp_path / f"run-step{step:08d}-state")
    save_state(path, {"w": w}, opt.state_dict(), sched, run, progress, shape_settings={"network_dim": 4})
    return path, w, opt, sched, run


def test_a_saved_state_reads_back_whole(tmp_path):
    path, w, opt, sched, run = small_run(tmp_path)
    saved = read_state(path)
    assert saved.progress == TrainProgress(epoch=2, global_step=5, batches_done=1)
    assert torch.equal(saved.weights["w"], w.detach())
    assert torch.equal(saved.optimizer["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert saved.scheduler == sched.state_dict()
    assert saved.flags == {"network_dim": 4} and saved.shape_settings == {"network_dim": 4}
    assert saved.world_size == 1 and saved.ema is None and saved.scaler is None
    assert sorted(os.listdir(path)) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                        "scheduler.bin", "train_state.json"]
    assert [p for p in os.listdir(tmp_path) if p != os.path.basename(path)] == []  # no temporary left


def test_restored_rngs_draw_what_the_saved_run_would_have_drawn(tmp_path):
    path, *_, run = small_run(tmp_path)
    expected = (random.random(), np.random.rand(), torch.rand(3), torch.randn(2, generator=run.noise_generator))
    other = RunState.start(99)
    other.restore_rng(read_state(path).rng)
    got = (random.random(), np.random.rand(), torch.rand(3), torch.randn(2, generator=other.noise_generator))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


def test_a_missing_or_truncated_file_is_named(tmp_path):
    path, *_ = small_run(tmp_path)
    with open(os.path.join(path, "optimizer.bin"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(DamagedState, match=r"optimizer\.bin is damaged \("):
        read_state(path)
    os.remove(os.path.join(path, "scheduler.bin"))
    with pytest.raises(DamagedState, match=r"scheduler\.bin is missing; the state is incomplete$"):
        read_state(path)


def test_state_folders_are_listed_newest_first_and_damaged_ones_last(tmp_path):
    old, *_ = small_run(tmp_path, step=3)
    new, *_ = small_run(tmp_path, step=9)
    broken = tmp_path / "run-broken-state"
    broken.mkdir()
    (broken / "train_state.json").write_text("{")
    assert state_folders(str(tmp_path)) == [new, old, str(broken)]
    assert json.loads((tmp_path / os.path.basename(new) / "train_state.json").read_text())["current_step"] == 9


def test_changed_flags_name_each_difference():
    assert changed_flags({"learning_rate": 1e-4, "seed": 1}, {"learning_rate": 2e-4, "seed": 1}) == \
        ["--learning_rate 0.0001 -> 0.0002"]
