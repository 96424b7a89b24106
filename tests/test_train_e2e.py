"""End-to-end LoRA training on the tiny SD models: files, metadata, loss, resume, stop, errors."""

from __future__ import annotations

import glob
import math
import os
import re
import signal

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.cli.entry import run_training
from library.core.errors import UserError
from library.train.trainer import InterruptedTraining, TrainingError
from tests.train_helpers import base_args, make_dataset, make_trainer

SD1_MODULES = 192 + 72  # UNet attention-block modules + CLIP-L modules
SD2_MODULES = 192 + 23 * 6  # SD2's text encoder has 23 layers


def fixed_batch_loss(trainer, multiplier: float) -> float:
    """Loss of the first batch at fixed timesteps and noise, with the network at `multiplier`."""
    net = trainer.accelerator.unwrap_model(trainer.network)
    net.set_multiplier(multiplier)
    net.eval()
    ref = trainer.data.epoch_batches(1, 0)[0]
    batch = trainer.data.load_batch(ref)
    total = 0.0
    from library.train.step import batch_loss

    with torch.no_grad():
        for t in (100, 300, 500, 700, 900):
            g = torch.Generator().manual_seed(t)
            loss, _ = batch_loss(trainer.ctx, batch, g, timesteps=torch.tensor([t]))
            total += loss.item()
    net.set_multiplier(1.0)
    return total


@pytest.mark.parametrize("preset,modules", [("tiny:sd1", SD1_MODULES), ("tiny:sd2-v", SD2_MODULES)])
def test_training_writes_lora_logs_and_loss_falls(tmp_path, preset, modules):
    data = make_dataset(str(tmp_path), n=2)
    out = str(tmp_path / "out")
    trainer = make_trainer(base_args(data, out, preset=preset, steps=24, extra=[
        "--learning_rate", "3e-3", "--save_every_n_steps", "12",
        "--log_with", "tensorboard", "--logging_dir", str(tmp_path / "logs")]))
    final = trainer.run()

    assert final == os.path.join(out, "lora.safetensors")
    assert os.path.isfile(os.path.join(out, "lora-step00000012.safetensors"))
    assert not glob.glob(os.path.join(out, ".*"))  # no temporary files left behind
    sd = load_file(final)
    assert len(sd) == modules * 3
    assert sum(k.endswith(".alpha") for k in sd) == modules
    with safe_open(final, "pt") as f:
        meta = f.metadata()
    assert meta["ss_steps"] == "24"
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "4.0"
    assert meta["ss_base_model_version"] == ("sd_v1" if preset == "tiny:sd1" else "sd_v2_v")
    assert meta["sshs_model_hash"] and meta["sshs_legacy_hash"]
    assert glob.glob(str(tmp_path / "logs" / "*" / "network_train" / "events.out.tfevents.*"))

    base_loss = fixed_batch_loss(trainer, 0.0)
    trained_loss = fixed_batch_loss(trainer, 1.0)
    assert trained_loss < base_loss * 0.95, (base_loss, trained_loss)


def _stop_at(step_to_stop: int):
    def hook(trainer, event, step):
        if event == "step" and step == step_to_stop:
            trainer._on_signal(signal.SIGTERM, None)
    return hook


def test_resumed_run_equals_uninterrupted(tmp_path):
    """Stop mid-epoch (SIGTERM path), resume with --resume auto: bitwise the same LoRA."""
    data = make_dataset(str(tmp_path), n=4)  # 4 images x 5 repeats = 20 batches/epoch
    extra = ["--gradient_accumulation_steps", "2", "--shuffle_caption", "--flip_aug",
             "--caption_dropout_rate", "0.2", "--network_dropout", "0.1",
             "--noise_offset", "0.05", "--lr_scheduler", "cosine_with_restarts",
             "--lr_scheduler_num_cycles", "2", "--lr_warmup_steps", "2"]
    steps = 14  # 10 steps per epoch: the run crosses an epoch boundary after the resume

    straight = make_trainer(base_args(data, str(tmp_path / "a"), steps=steps, extra=extra)).run()

    out_b = str(tmp_path / "b")
    first = make_trainer(base_args(data, out_b, steps=steps, extra=extra))
    first.s.hooks.append(_stop_at(7))
    with pytest.raises(InterruptedTraining) as stopped:
        first.run()
    assert stopped.value.state_dir.endswith("lora-step00000007-state")
    assert stopped.value.signum == signal.SIGTERM
    resumed = make_trainer(base_args(data, out_b, steps=steps, extra=extra + ["--resume", "auto"])).run()

    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_of_finished_run_is_an_error(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    make_trainer(base_args(data, out, steps=2, extra=["--save_state"])).run()
    state = re.escape(os.path.join(out, "lora-state"))
    with pytest.raises(UserError, match=rf"^--resume {state}: that run already finished \(2 of 2 steps\); "
                                        r"raise --max_train_steps/--max_train_epochs to go on$"):
        make_trainer(base_args(data, out, steps=2, extra=["--resume", "auto"])).run()


def test_nan_loss_stops_with_step_and_images(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    trainer = make_trainer(base_args(data, out, steps=6, extra=["--save_every_n_steps", "2"]))

    def poison(tr, event, step):
        if event == "step" and step == 2:
            net = tr.accelerator.unwrap_model(tr.network)
            with torch.no_grad():
                next(p for p in net.parameters()).fill_(float("nan"))

    trainer.s.hooks.append(poison)
    with pytest.raises(TrainingError, match=r"step 3: loss is nan .*img0\.png"):
        trainer.run()
    assert os.path.isfile(os.path.join(out, "lora-step00000002.safetensors"))
    assert not os.path.exists(os.path.join(out, "lora.safetensors"))


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    code = run_training("sd", "test", base_args(str(tmp_path / "missing"), str(tmp_path / "out")))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and "missing" in err[0]
    assert not os.path.exists(tmp_path / "out")  # a run that never started leaves nothing behind


def test_cli_writes_the_run_config_once_training_starts(tmp_path):
    import toml

    data = make_dataset(str(tmp_path), n=1)
    assert run_training("sd", "test", base_args(data, str(tmp_path / "out"), steps=1)) == 0
    config = toml.load(tmp_path / "out" / "lora_config.toml")
    flat = {k: v for section in config.values() for k, v in section.items()} if all(
        isinstance(v, dict) for v in config.values()) else config
    assert flat["max_train_steps"] == 1 and flat["train_data_dir"] == data


def test_cli_rejects_unknown_config_file_key(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[training]\nmax_train_step = 10\n')
    code = run_training("sd", "test", ["--config_file", str(cfg)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"error: {cfg}: training.max_train_step: unknown flag (did you mean max_train_steps?)"


def test_save_cadence_and_retention_on_disk(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    out = tmp_path / "out"
    make_trainer(base_args(data, str(out), steps=5, extra=[
        "--save_every_n_steps", "1", "--save_last_n_steps", "2", "--save_state"])).run()
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".toml")) == [
        "lora-state", "lora-step00000002-state", "lora-step00000002.safetensors",
        "lora-step00000003-state", "lora-step00000003.safetensors",
        "lora-step00000004-state", "lora-step00000004.safetensors", "lora.safetensors"]


def test_validation_loss_is_logged_at_fixed_timesteps(tmp_path, monkeypatch):
    from library.train.observe.tracking import Tracker

    data = make_dataset(str(tmp_path), n=4)
    logged = []
    monkeypatch.setattr(Tracker, "log", lambda self, values, step: logged.append((step, dict(values))))
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=4, extra=[
        "--validation_split", "0.25", "--validate_every_n_steps", "2", "--max_validation_steps", "1"]))
    trainer.run()
    assert trainer.data.num_validation_images == 1
    val = [(step, v["loss/validation/step_average"]) for step, v in logged if "loss/validation/step_average" in v]
    assert [step for step, _ in val] == [2, 4]
    assert all(math.isfinite(value) and value > 0 for _, value in val)  # value == value let an infinity through
    # Fixed noise and timesteps: with the network at multiplier 0 the value is the base model's, every time.
    from library.train.validation import validation_loss

    net = trainer.accelerator.unwrap_model(trainer.network)
    net.set_multiplier(0.0)
    refs = trainer.data.validation_batches()[:1]
    first = validation_loss(trainer.ctx, trainer.data, refs, seed=5)
    assert validation_loss(trainer.ctx, trainer.data, refs, seed=5) == first


def test_missing_optimizer_package_is_reported_before_data_and_model(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    argv = base_args(str(tmp_path / "missing"), str(tmp_path / "out"), extra=["--optimizer_type", "AdamW8bit"])
    assert run_training("sd", "test", argv) == 2
    assert capsys.readouterr().err.strip() == ("error: --optimizer_type AdamW8bit needs bitsandbytes: pip install bitsandbytes "
                                              "(or, in this repository: pip install .[optim])")
