"""Full fine-tuning (fine_tune.py / sdxl_train.py / flux_train.py) and EMA, on the tiny presets."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from library.cli.entry import run_training
from library.families import get_family
from library.families.base import LoadOptions
from library.train.trainer import InterruptedTraining
from tests.train_helpers import assert_close_measured, base_args, ft_args, ft_trainer, make_dataset, make_trainer


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.parametrize("flags,trains_unet,trains_te", [
    ([], True, False),
    (["--train_text_encoder"], True, True),
    (["--train_text_encoder", "--learning_rate_te", "1e-3", "--learning_rate", "0"], False, True),
])
def test_exactly_the_intended_parts_train_and_the_file_holds_them(tmp_path, tiny_sd1, flags, trains_unet, trains_te):
    data = make_dataset(str(tmp_path), n=1)
    trainer = ft_trainer(ft_args(data, str(tmp_path / "out"), extra=flags))  # a later --learning_rate wins
    path = trainer.run()
    c = trainer.components
    unet_before, te_before, vae_before = _state(tiny_sd1.denoiser), _state(tiny_sd1.text_encoders[0]), _state(tiny_sd1.vae)
    assert bool(_changed(unet_before, _state(c.denoiser))) == trains_unet
    assert bool(_changed(te_before, _state(c.text_encoders[0]))) == trains_te
    assert not _changed(vae_before, _state(c.vae))
    assert path == os.path.join(str(tmp_path / "out"), "model.safetensors")
    loaded = get_family("sd").load(LoadOptions(path))
    for part, trained in ((loaded.denoiser, c.denoiser), (loaded.text_encoders[0], c.text_encoders[0]),
                          (loaded.vae, c.vae)):
        got, want = part.state_dict(), trained.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k].float(), want[k].float()) for k in want)


@pytest.mark.parametrize("fmt", ["diffusers_safetensors", "ckpt"])
def test_other_formats_load_back_equal(tmp_path, fmt):
    data = make_dataset(str(tmp_path), n=1)
    trainer = ft_trainer(ft_args(data, str(tmp_path / "out"), steps=1, extra=["--save_model_as", fmt]))
    path = trainer.run()
    assert path == os.path.join(str(tmp_path / "out"), "model" if fmt.startswith("diffusers") else "model.ckpt")
    loaded = get_family("sd").load(LoadOptions(path))
    want = trainer.components.denoiser.state_dict()
    got = loaded.denoiser.state_dict()
    assert all(torch.equal(got[k].float(), want[k].float()) for k in want)


@pytest.mark.parametrize("fused", [False, True])
def test_full_fine_tune_resume_is_bitwise_equal(tmp_path, fused):
    data = make_dataset(str(tmp_path), n=2)
    extra = ["--train_text_encoder", "--use_ema", "--shuffle_caption", "--optimizer_type", "AdamW"]
    extra += ["--fused_backward_pass"] if fused else []
    straight = ft_trainer(ft_args(data, str(tmp_path / "a"), steps=4, extra=extra)).run()
    out = str(tmp_path / "b")
    first = ft_trainer(ft_args(data, out, steps=4, extra=extra + ["--save_state"]))

    def stop_at_2(trainer, event, step):
        if event == "step" and step == 2:
            trainer._on_signal(15, None)

    first.s.hooks.append(stop_at_2)
    with pytest.raises(InterruptedTraining):
        first.run()
    resumed = ft_trainer(ft_args(data, out, steps=4, extra=extra + ["--resume", "auto"])).run()
    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_ema_equals_an_independent_ema_of_the_per_step_weights(tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    decay, every = 0.8, 2
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=7, extra=[
        "--use_ema", "--ema_decay", str(decay), "--ema_update_every", str(every), "--ema_start_step", "2",
        "--save_ema_only", "false"]))
    per_step = {}

    def record(tr, event, step):
        if event == "step":
            per_step[step] = {k: v.detach().clone().float() for k, v in tr.trainable.module.named_parameters()}

    trainer.s.hooks.append(record)
    path = trainer.run()
    ema, updates = None, 0
    for step in sorted(per_step):
        if step < 2:
            continue
        if ema is None:
            ema = {k: v.clone() for k, v in per_step[step].items()}
        elif (step - 2) % every == 0:
            d = min(decay, (1 + updates) / (10 + updates))
            ema = {k: d * ema[k] + (1 - d) * per_step[step][k] for k in ema}
            updates += 1
    assert updates == 2  # steps 4 and 6
    saved = load_file(path)
    raw = load_file(os.path.join(str(tmp_path / "out"), "lora-nonema.safetensors"))
    for key, value in ema.items():  # networks.lora: parameter names are the file's keys
        assert torch.allclose(saved[key].float(), value, atol=1e-6), key
        assert torch.equal(raw[key].float(), per_step[7][key]), key
    assert not all(torch.equal(saved[k].float(), raw[k].float()) for k in ema)


@pytest.mark.parametrize("script,preset,family", [("sdxl", "tiny:sdxl", "sdxl"), ("flux", "tiny:flux", "flux")])
def test_sdxl_and_flux_fine_tune_save_and_load_back(tmp_path, script, preset, family):
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    extra = ["--t5xxl_max_token_length", "8"] if family == "flux" else []
    assert run_training(family, "test", ft_args(data, out, preset=preset, steps=1, extra=extra), fine_tune=True) == 0
    path = os.path.join(out, "model.safetensors")
    assert os.path.isfile(path)
    if family == "sdxl":
        loaded = get_family("sdxl").load(LoadOptions(path))
        assert sum(p.numel() for p in loaded.denoiser.parameters()) > 0


def test_fine_tune_refuses_fp8_and_fused_backward_with_accumulation(tmp_path, capsys):
    data = make_dataset(str(tmp_path), n=1)
    code = run_training("sd", "test", ft_args(data, str(tmp_path / "o"), extra=["--fp8_base"]), fine_tune=True)
    assert code == 2
    assert capsys.readouterr().err.strip() == ("error: --fp8_base: float8 weights cannot be trained; "
                                               "it is for LoRA training only")
    code = run_training("sd", "test", ft_args(data, str(tmp_path / "o"), extra=[
        "--fused_backward_pass", "--gradient_accumulation_steps", "2"]), fine_tune=True)
    assert code == 2
    assert "cannot accumulate" in capsys.readouterr().err


@pytest.mark.parametrize("fused_flags", [["--fused_backward_pass"], ["--fused_optimizer_groups", "3"]])
def test_fused_backward_pass_equals_the_usual_step_and_holds_no_gradients(tmp_path, fused_flags):
    data = make_dataset(str(tmp_path), n=1)
    common = ["--optimizer_type", "AdamW", "--max_grad_norm", "0", "--train_text_encoder"]
    usual = ft_trainer(ft_args(data, str(tmp_path / "a"), steps=3, extra=common))
    a = load_file(usual.run())
    fused = ft_trainer(ft_args(data, str(tmp_path / "b"), steps=3, extra=common + fused_flags))
    held = []
    fused.s.hooks.append(lambda tr, event, step: held.append(
        sum(p.grad is not None for p in tr.trainable.module.parameters())) if event == "step" else None)
    b = load_file(fused.run())
    assert held == [0, 0, 0]
    assert len(fused.optimizer.optimizer.chunks if hasattr(fused.optimizer, "optimizer") else fused.optimizer.chunks) \
        == (3 if "3" in fused_flags else sum(1 for _ in fused.trainable.module.parameters()))
    # measured 0 for both with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY) (one float32 step of these
    # weights is ~1e-7); gradients rounded through float16 before
    # each fused step give 2.2e-3
    assert_close_measured(b, a, 1e-5, f"{fused_flags[0]} vs usual step: weights")


def test_sdxl_block_lr_trains_each_block_at_its_rate_and_freezes_zero_blocks(tmp_path, tiny_sdxl):
    data = make_dataset(str(tmp_path), n=1)
    rates = ["1e-3"] * 23
    rates[10:13] = ["0", "0", "0"]  # the middle block stays frozen
    rates[0] = "5e-4"
    trainer = ft_trainer(ft_args(data, str(tmp_path / "out"), preset="tiny:sdxl", steps=1, extra=[
        "--block_lr", ",".join(rates)]), "sdxl")
    before = _state(tiny_sdxl.denoiser)
    trainer.run()
    after = _state(trainer.components.denoiser)
    changed = _changed(before, after)
    assert changed and not any(k.startswith("mid_block.") for k in changed)
    assert any(k.startswith("down_blocks.") for k in changed) and any(k.startswith("up_blocks.") for k in changed)
    lrs = {name: g["lr"] for name, g in zip(trainer.group_names, trainer.optimizer.param_groups)}
    assert lrs["denoiser block 0"] == 5e-4 and "denoiser block 10" not in lrs and len(lrs) == 20


def test_block_lr_needs_the_familys_block_count(tmp_path, capsys):
    data = make_dataset(str(tmp_path), n=1)
    code = run_training("sdxl", "t", ft_args(data, str(tmp_path / "o"), preset="tiny:sdxl", extra=[
        "--block_lr", "1e-3,1e-3"]), fine_tune=True)
    assert code == 2
    assert capsys.readouterr().err.strip() == ("error: --block_lr: expected 23 comma-separated rates >= 0 "
                                               "(emb, IN00-IN08, MID0-MID2, OUT00-OUT08, out), got 2")


def test_from_scratch_learns_on_the_example_images(tmp_path, monkeypatch):
    """--from_scratch on tiny:sd1: the seeded random UNet's loss falls (the full curve is in docs/fine_tune.md)."""
    from library.train.observe.tracking import Tracker

    losses = {}
    real_log = Tracker.log
    monkeypatch.setattr(Tracker, "log", lambda self, values, step: (
        losses.__setitem__(step, values["loss/current"]) if "loss/current" in values else None,
        real_log(self, values, step)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ft_args(os.path.join(root, "examples", "data", "train"), str(tmp_path / "out"), steps=24, extra=[
        "--from_scratch", "--seed", "42", "--cache_latents", "--train_batch_size", "2", "--optimizer_type", "AdamW"])
    ft_trainer(argv).run()
    first = sum(losses[s] for s in range(1, 9)) / 8
    last = sum(losses[s] for s in range(17, 25)) / 8
    assert last < 0.6 * first, (first, last)
