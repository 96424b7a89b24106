"""Resume and stop behaviour users met switching from sd-scripts (issue 11, items 1, 2, 3, 14, 15, 16, 22)."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file

from library.cli.entry import run_training
from library.core.errors import UserError
from library.families import get_family
from tests.train_helpers import base_args, make_dataset, make_trainer, random_lora_file


def _equal_files(a: str, b: str) -> None:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


def test_resume_auto_after_max_train_steps_mid_epoch_continues_exactly(tmp_path):
    """Item 1: stopped by --max_train_steps mid-epoch, resumed with a higher limit: no crash, bitwise equal."""
    data = make_dataset(str(tmp_path), n=2)  # 2 images x 5 repeats = 10 batches per epoch
    extra = ["--shuffle_caption", "--flip_aug", "--noise_offset", "0.05"]
    straight = make_trainer(base_args(data, str(tmp_path / "a"), steps=14, extra=extra)).run()
    out = str(tmp_path / "b")
    make_trainer(base_args(data, out, steps=7, extra=extra + ["--save_state"])).run()
    with open(os.path.join(out, "lora-state", "train_state.json")) as f:
        assert '"current_epoch": 1, "current_step": 7, "batches_done": 7' in f.read()
    resumed = make_trainer(base_args(data, out, steps=14, extra=extra + ["--resume", "auto"])).run()
    _equal_files(straight, resumed)


def _damage(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(max(1, os.path.getsize(path) // 3))


def test_damaged_newest_state_falls_back_and_explicit_path_is_one_line(tmp_path, caplog):
    """Item 14: --resume auto skips a truncated state for the newest intact one; a named one is refused."""
    data = make_dataset(str(tmp_path), n=2)
    straight = make_trainer(base_args(data, str(tmp_path / "a"), steps=6)).run()
    out = str(tmp_path / "b")
    make_trainer(base_args(data, out, steps=4, extra=["--save_state", "--save_every_n_steps", "2"])).run()
    newest = os.path.join(out, "lora-state")
    _damage(os.path.join(newest, "optimizer.bin"))
    with pytest.raises(UserError, match=rf"^--resume {re.escape(newest)}: optimizer.bin is damaged \("):
        make_trainer(base_args(data, out, steps=6, extra=["--resume", newest])).run()
    with caplog.at_level(logging.INFO):
        resumed = make_trainer(base_args(data, out, steps=6, extra=["--resume", "auto"])).run()
    assert f"--resume auto: skipping {newest}: optimizer.bin is damaged" in caplog.text
    assert "newest intact state is " + os.path.join(out, "lora-step00000002-state") in caplog.text
    _equal_files(straight, resumed)
    open(os.path.join(out, "lora-step00000002-state", "model.safetensors"), "w").close()  # empty file
    with pytest.raises(UserError, match=r"model.safetensors is damaged"):
        make_trainer(base_args(data, out, steps=6, extra=["--resume", os.path.join(out, "lora-step00000002-state")])).run()


def test_resume_with_other_network_dim_names_the_difference(tmp_path):
    """Item 15: a state saved with --network_dim 4 resumed with 8 is refused by name before training."""
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    make_trainer(base_args(data, out, steps=2, extra=["--save_state"])).run()
    argv = base_args(data, out, steps=4, extra=["--resume", "auto"])
    argv[argv.index("--network_dim") + 1] = "8"
    state = re.escape(os.path.join(out, "lora-state"))
    with pytest.raises(UserError, match=rf"^--resume {state}: the state was saved with other shape flags "
                                        r"\(network_dim 4 -> 8\)"):
        make_trainer(argv).run()


def test_resume_names_every_changed_flag_in_one_warning_line(tmp_path, caplog):
    """Issue 22: --resume auto with another --learning_rate (and --flip_aug, --max_train_steps) was accepted without
    a word. One line names each change; output, saving and logging flags may differ silently; the same flags say
    nothing. The saved optimizer and scheduler keep their rates, and the line says so."""
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    make_trainer(base_args(data, out, steps=2, extra=["--save_state"])).run()
    with caplog.at_level(logging.WARNING, logger="library.train.state"):
        make_trainer(base_args(data, out, steps=3, extra=["--save_state", "--resume", "auto"])).run()
    assert [r.getMessage() for r in caplog.records if r.name == "library.train.state"] == [
        f"--resume {out}/lora-state: these flags differ from the saved run: --max_train_steps 2 -> 3"]
    caplog.clear()
    argv = base_args(data, out, steps=4, extra=["--resume", "auto", "--flip_aug", "--save_every_n_steps", "1",
                                                "--logging_dir", str(tmp_path / "logs"), "--output_name", "other"])
    argv[argv.index("--learning_rate") + 1] = "2e-3"
    trainer = make_trainer(argv)
    with caplog.at_level(logging.WARNING, logger="library.train.state"):
        trainer.run()
    assert [r.getMessage() for r in caplog.records if r.name == "library.train.state"] == [
        f"--resume {out}/lora-state: these flags differ from the saved run: --flip_aug False -> True, "
        "--learning_rate 0.001 -> 0.002, --max_train_steps 3 -> 4 "
        "(the learning rates go on from the saved optimizer and scheduler)"]
    assert {g["initial_lr"] for g in trainer.optimizer.param_groups} == {1e-3}  # what the line says


def test_changed_flags_leaves_out_shape_and_output_flags_and_flags_an_old_state_lacks():
    from library.train.state import changed_flags

    saved = {"learning_rate": 1e-4, "network_dim": 4, "output_dir": "a", "save_every_n_steps": None,
             "network_args": ["conv_dim=4"], "seed": 1, "resolution": "64"}
    current = {"learning_rate": 2e-4, "network_dim": 8, "output_dir": "b", "save_every_n_steps": 5,
               "network_args": ["conv_dim=8"], "seed": None, "resolution": "64", "new_flag": 1}
    assert changed_flags(saved, current, refused={"network_dim"}) == [
        "--learning_rate 0.0001 -> 0.0002", "--network_args [conv_dim=4] -> [conv_dim=8]", "--seed 1 -> (not set)"]


def test_dim_from_weights_starts_from_the_files_values(tmp_path, tiny_sd1):
    """Item 3: --network_weights F --dim_from_weights builds the network from F's shapes AND loads F's values."""
    family = get_family("sd")
    path = random_lora_file(family, tiny_sd1, str(tmp_path / "init.safetensors"), seed=3)
    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=1, extra=[
        "--network_weights", path, "--dim_from_weights"]))
    trainer._setup_accelerator()
    trainer._setup_data()
    trainer.components, trainer.block_swapper = trainer._setup_model()
    trainer.trainable = trainer._setup_trainable()
    saved = load_file(path)
    state = trainer.trainable.module.state_dict()
    ups = [k for k in saved if k.endswith("lora_up.weight")]
    assert len(ups) == 264
    for key in ups:
        assert torch.equal(state[key], saved[key]), key


@pytest.mark.parametrize("rates,expected", [(["1e-5"], {1e-5}), (["1e-5", "2e-5"], {1e-5, 2e-5})])
def test_lycoris_takes_one_or_two_text_encoder_rates(tmp_path, rates, expected):
    """Item 2: LyCORIS with --text_encoder_lr (one value, or one per SDXL encoder) builds its optimizer."""
    pytest.importorskip("lycoris")
    data = make_dataset(str(tmp_path), n=1)
    argv = base_args(data, str(tmp_path / "out"), preset="tiny:sdxl", steps=1, extra=[
        "--text_encoder_lr", *rates, "--unet_lr", "1e-4"])
    argv[argv.index("--network_module") + 1] = "lycoris.kohya"
    argv += ["--network_args", "algo=lora"]
    trainer = make_trainer(argv, "sdxl")
    trainer._setup_accelerator()
    trainer._setup_data()
    trainer.components, trainer.block_swapper = trainer._setup_model()
    trainer.trainable = trainer._setup_trainable()
    trainer._setup_optimizer()
    lrs = {g["lr"] for g in trainer.optimizer.param_groups}
    assert lrs == expected | {1e-4}
    if len(rates) == 2:
        assert trainer.group_names.count("textencoder 1") == 1 and trainer.group_names.count("textencoder 2") == 1


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN])
def test_signal_while_loading_stops_cleanly_in_one_line(tmp_path, capsys, monkeypatch, inherited):
    """Item 16: SIGINT while the model loads (also when the job inherited SIG_IGN): exit 130, one line, no files."""
    family = get_family("sd")
    real_load = type(family).load

    def load_then_interrupted(self, opts):
        components = real_load(self, opts)
        os.kill(os.getpid(), signal.SIGINT)
        return components

    monkeypatch.setattr(type(family), "load", load_then_interrupted)
    previous = signal.signal(signal.SIGINT, inherited)
    try:
        data = make_dataset(str(tmp_path), n=1)
        code = run_training("sd", "test", base_args(data, str(tmp_path / "out"), steps=2))
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert err == ["stopped by signal 2 before training started; nothing more was saved"]
    assert not os.path.exists(tmp_path / "out" / "lora.safetensors")
    assert signal.getsignal(signal.SIGINT) is previous


def test_undecodable_batch_is_not_a_step_and_the_run_reports(tmp_path, caplog):
    """Item 22: a batch whose every image fails to decode takes no step; the end-of-run summary names it."""
    data = make_dataset(str(tmp_path), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=6))
    broken = os.path.join(data, "5_sks toy", "img1.png")

    def corrupt(tr, event, step):
        if event == "train_start":
            with open(broken, "wb") as f:
                f.write(b"\x89PNG truncated")

    trainer.s.hooks.append(corrupt)
    taken = []
    real_step = trainer._optimizer_step
    trainer._optimizer_step = lambda step: (taken.append(step), real_step(step))
    with caplog.at_level(logging.INFO):
        trainer.run()
    # 2 images x 5 repeats, one epoch planned for 6 steps: the 5 batches of img1 take no step, so the
    # planned epoch ends after 5 steps and the summary says so.
    assert taken == [1, 2, 3, 4, 5]
    assert trainer.run_state.progress.global_step == 5
    assert trainer.skipped_images == {broken}
    assert "run ended at step 5 of 6" in caplog.text
    assert f"1 image(s) failed to decode during training and were skipped:\n  {broken}" in caplog.text


@pytest.mark.parametrize("extra, hint", [
    ([], "try a lower learning rate"),
    (["--max_grad_norm", "0"], "try --max_grad_norm 1 (gradient clipping is off) or a lower learning rate"),
])
def test_nan_hint_suggests_only_what_the_run_has_not_set(tmp_path, extra, hint):
    """Item 22 / issue 22: the NaN hint named --mixed_precision bf16 / no and --no_half_vae to every run, also to
    one that already had --mixed_precision no (the default); it now follows the run's settings."""
    from library.train.trainer import TrainingError

    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=3, extra=extra))

    def poison(tr, event, step):
        if event == "step" and step == 1:
            with torch.no_grad():
                next(tr.trainable.module.parameters()).fill_(float("nan"))

    trainer.s.hooks.append(poison)
    with pytest.raises(TrainingError) as e:
        trainer.run()
    assert str(e.value).startswith("step 2: loss is nan (not finite); stopping.")
    assert str(e.value).endswith(f"The files saved so far are intact; {hint}"), str(e.value)


@pytest.mark.parametrize("extra, hint", [
    (["--mixed_precision", "bf16"], "try --mixed_precision no (float32), --no_half_vae or a lower learning rate"),
    (["--mixed_precision", "bf16", "--no_half_vae"], "try --mixed_precision no (float32) or a lower learning rate"),
    (["--mixed_precision", "fp16", "--full_fp16", "--max_grad_norm", "0"],
     "try --mixed_precision bf16 (or no, for float32), training without --full_fp16, --no_half_vae, "
     "--max_grad_norm 1 (gradient clipping is off) or a lower learning rate"),
])
def test_nan_hint_of_half_precision_runs(tmp_path, extra, hint):
    """The same hint for runs in half precision (not run: the process's accelerate state is float32)."""
    trainer = make_trainer(base_args(str(tmp_path), str(tmp_path / "out"), extra=extra))
    assert trainer._nan_hint() == hint


def test_too_little_disk_space_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """Item 13: free space is checked against one save (+ state) before step 1."""
    import library.train.observe.disk_space as disk_space

    monkeypatch.setattr(disk_space, "free_bytes", lambda folder: 2**20)
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    assert run_training("sd", "test", base_args(data, out, steps=2, extra=["--save_state"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert re.fullmatch(rf"error: --output_dir {re.escape(out)}: 1 MiB free, but one save and its state needs "
                        r"about \d+ MiB; free some space or choose another folder", err[0]), err[0]


def test_disk_full_during_a_save_is_one_line_and_earlier_files_stay(tmp_path):
    """Item 13: ENOSPC while saving names the path and the space needed; the previous save is intact."""
    import errno

    from library.train.observe.disk_space import DiskFull

    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    trainer = make_trainer(base_args(data, out, steps=3, extra=["--save_every_n_steps", "1"]))

    def fill_disk(tr, event, step):
        if event == "step" and step == 1:
            def no_space(path, metadata):
                raise OSError(errno.ENOSPC, "No space left on device", path)
            tr.trainable.save = no_space

    trainer.s.hooks.append(fill_disk)
    with pytest.raises(DiskFull) as e:
        trainer.run()
    path = os.path.join(out, "lora-step00000002.safetensors")
    assert re.fullmatch(rf"{re.escape(path)}: the disk is full \(\d+ MiB free, this save needs about \d+ MiB\); "
                        r"nothing was half-written and the files saved before are intact; free some space and "
                        r"resume with --resume auto", str(e.value)), str(e.value)
    assert len(load_file(os.path.join(out, "lora-step00000001.safetensors"))) == 264 * 3


def test_more_processes_than_batches_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Data parallel (issue 13): each process needs at least one batch of every epoch; refused before the model loads."""
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    data = make_dataset(str(tmp_path / "one"), n=1)
    os.rename(os.path.join(data, "5_sks toy"), os.path.join(data, "1_sks toy"))  # 1 image, 1 repeat: 1 batch
    assert run_training("sd", "test", base_args(data, str(tmp_path / "out"), steps=1)) == 2
    assert capsys.readouterr().err.strip() == (
        "error: 2 processes but only 1 batch(es) per epoch: every process needs at least one; use fewer processes "
        "or a smaller --train_batch_size")


def test_persistent_data_loader_workers_are_used_and_change_nothing(tmp_path, monkeypatch):
    """Item 10: --persistent_data_loader_workers keeps one set of workers across epochs; same LoRA."""
    import torch.utils.data

    data = make_dataset(str(tmp_path), n=1)  # 5 batches per epoch: 7 steps cross an epoch
    plain = make_trainer(base_args(data, str(tmp_path / "a"), steps=7)).run()
    made = []
    real_init = torch.utils.data.DataLoader.__init__

    def spy(self, *args, **kwargs):
        made.append(kwargs.get("persistent_workers"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", spy)
    argv = base_args(data, str(tmp_path / "b"), steps=7, extra=["--persistent_data_loader_workers"])
    argv[argv.index("--max_data_loader_n_workers") + 1] = "2"
    persistent = make_trainer(argv).run()
    assert made == [True]
    _equal_files(plain, persistent)


# --- issue 22, item 4: a NaN is never written; a full disk is one line whatever the writer ------------------------

def _finite_file(path: str) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(path).values())


def test_first_non_finite_names_the_first_and_ignores_overflowing_sums():
    """The check sums each tensor in float32: a NaN / inf anywhere is found, named in order (nested optimizer
    state by its path), and finite values whose sum overflows (3e38 x 1000; float16 60000 x 1e5) are not a NaN."""
    from library.train.saving import first_non_finite, named_tensors

    inf, nan = torch.zeros(10), torch.ones(3, 4)
    inf[3], nan[1, 2] = float("inf"), float("nan")
    assert first_non_finite([("a", torch.zeros(3)), ("b", inf), ("c", nan)]) == "b"
    assert first_non_finite([("c", nan), ("b", inf)]) == "c"
    assert first_non_finite([("big", torch.full((1000,), 3e38)),
                             ("half", torch.full((100000,), 60000.0, dtype=torch.float16)),
                             ("steps", torch.tensor([2**40])), ("empty", torch.empty(0))]) is None
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)}, 1: {"exp_avg": nan}},
             "param_groups": [{"lr": 1.0}]}
    assert first_non_finite(named_tensors(state, "optimizer state")) == "optimizer state.state.1.exp_avg"


@pytest.mark.parametrize("where, expected", [
    ("weights", "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight"),
    ("optimizer", "optimizer state.state.5.exp_avg_sq"),
])
def test_non_finite_tensors_are_not_saved(tmp_path, monkeypatch, where, expected):
    """Issue 22: a run whose weights became NaN after an optimizer step saved them (lora-step00000004 held 156,768
    non-finite values) and only stopped at the next loss. Now the save is refused, naming the tensor; the state
    check covers the optimizer state too (there the model file, finite, is written, the state is not)."""
    from library.train.saving import NonFiniteWeights
    from library.train.adapters.trainables import AdapterTrainable

    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    trainer = make_trainer(base_args(data, out, steps=4, extra=["--save_every_n_steps", "1", "--save_state"]))
    calls = []
    real = AdapterTrainable.after_optimizer_step

    def after_step(self, device):
        calls.append(1)
        if len(calls) == 2:  # after step 2's optimizer step, before its save
            with torch.no_grad():
                if where == "weights":
                    module = next(m for m in self.module.modules()
                                  if getattr(m, "lora_name", None) == expected.split(".")[0])
                    module.lora_up.weight[0, 0] = float("inf")
                else:
                    trainer.optimizer.state_dict()["state"][5]["exp_avg_sq"].view(-1)[3] = float("nan")
        return real(self, device)

    monkeypatch.setattr(AdapterTrainable, "after_optimizer_step", after_step)
    with pytest.raises(NonFiniteWeights) as e:
        trainer.run()
    what = (os.path.join(out, "lora-step00000002.safetensors") if where == "weights"
            else os.path.join(out, "lora-step00000002-state"))
    assert str(e.value) == (f"step 2: {expected} is not finite (NaN or inf); not saving {what}. Training diverged; "
                            "the files saved so far are intact; try a lower learning rate")
    saved = ["lora-step00000001-state", "lora-step00000001.safetensors"]
    if where == "optimizer":
        saved.insert(2, "lora-step00000002.safetensors")
    assert sorted(os.listdir(out)) == saved
    for name in saved:
        if name.endswith(".safetensors"):
            assert _finite_file(os.path.join(out, name))
    assert _finite_file(os.path.join(out, "lora-step00000001-state", "model.safetensors"))


def test_diverging_run_from_the_issue_keeps_only_finite_files(tmp_path):
    """Issue 22's command (AdamW --learning_rate 10 --max_grad_norm 0 --save_every_n_steps 1 --save_state) on a tiny
    SD 1.x model: the run stops at the first save of non-finite weights; every file it wrote is finite."""
    from library.train.saving import NonFiniteWeights

    data = make_dataset(str(tmp_path), n=2, sizes=((64, 64),))
    out = str(tmp_path / "out")
    argv = ["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir", data, "--caption_extension", ".txt",
            "--resolution", "64", "--train_batch_size", "1", "--max_data_loader_n_workers", "0",
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "10", "--max_grad_norm", "0", "--max_train_steps", "10",
            "--seed", "1", "--output_dir", out, "--output_name", "lora", "--save_every_n_steps", "1", "--save_state"]
    trainer = make_trainer(argv)
    with pytest.raises(NonFiniteWeights) as e:
        trainer.run()
    m = re.fullmatch(r"step (\d+): (\S+) is not finite \(NaN or inf\); not saving (\S+)\. Training diverged; the "
                     r"files saved so far are intact; try --max_grad_norm 1 \(gradient clipping is off\) or a lower "
                     r"learning rate", str(e.value))
    assert m, str(e.value)
    step = int(m.group(1))
    assert m.group(3) == os.path.join(out, f"lora-step{step:08d}.safetensors")
    assert not bool(torch.isfinite(trainer.trainable.weights()[m.group(2)]).all())
    assert step >= 2  # at least one save before it
    expected = sorted([f"lora-step{s:08d}.safetensors" for s in range(1, step)]
                      + [f"lora-step{s:08d}-state" for s in range(1, step)])
    assert sorted(os.listdir(out)) == expected
    for s in range(1, step):
        assert _finite_file(os.path.join(out, f"lora-step{s:08d}.safetensors"))
        assert _finite_file(os.path.join(out, f"lora-step{s:08d}-state", "model.safetensors"))


def _error_lines(err: str) -> list[str]:
    """The "error: ..." lines of stderr (tqdm's bar may precede one on its line), or the traceback's lines."""
    assert "Traceback" not in err, err
    return re.findall(r"error: [^\n]*", err)


def _full_disk_run(tmp_path, fault, extra=()):
    """A 3-step run saving every step, `fault(trainer)` installed after step 1's save; (trainer, out)."""
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    trainer = make_trainer(base_args(data, out, steps=3, extra=["--save_every_n_steps", "1", *extra]))

    def hook(tr, event, step):
        if event == "step" and step == 1:
            fault()

    trainer.s.hooks.append(hook)
    return trainer, out


_FULL = (r"the disk is full \(\d+ MiB free, this save needs about \d+ MiB\); nothing was half-written and the files "
         r"saved before are intact; free some space and resume with --resume auto")


def test_safetensors_error_of_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    """Issue 22: without --save_state the third save on a 2 MB tmpfs ended in a traceback, safetensors'
    SafetensorError "... No space left on device" (naming_a_full_disk caught only OSError). The writer here
    writes part of the file, then raises what safetensors raises."""
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file
    seen = []

    def full(tensors, filename, metadata=None):
        seen.append(filename)
        with open(filename, "wb") as f:
            f.write(b"x" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")

    def hook(tr, event, step):
        if event == "step" and step == 1:
            monkeypatch.setattr(safetensors.torch, "save_file", full)

    from library.cli import entry
    monkeypatch.setattr(entry, "Trainer", _with_hook(entry.Trainer, hook))
    code = run_training("sd", "test", base_args(data, out, steps=3, extra=["--save_every_n_steps", "1"]))
    err = _error_lines(capsys.readouterr().err)
    path = os.path.join(out, "lora-step00000002.safetensors")
    assert code == 2
    assert len(err) == 1 and re.fullmatch(rf"error: {re.escape(path)}: {_FULL}", err[0]), err
    assert sorted(os.listdir(out)) == ["lora-step00000001.safetensors", "lora_config.toml"]  # no temporary left
    assert len(real and load_file(os.path.join(out, "lora-step00000001.safetensors"))) == 264 * 3
    assert len(seen) == 1 and os.path.basename(seen[0]) == "lora-step00000002.safetensors"  # inside our temporary
    assert os.path.basename(os.path.dirname(seen[0])).startswith(".lora-step00000002.safetensors.")


def _with_hook(trainer_cls, hook):
    class Hooked(trainer_cls):
        def __init__(self, family, settings, *args, **kwargs):
            settings.hooks.append(hook)
            super().__init__(family, settings, *args, **kwargs)
    return Hooked


@pytest.mark.parametrize("free, expected", [
    (0, _FULL),
    (None, r"could not be written \(\[enforce fail at inline_container\.cc:672\] \. unexpected pos 929024 vs "
           r"928912\); nothing was half-written and the files saved before are intact; resume with --resume auto "
           r"once it can be written"),
])
def test_torch_save_failure_in_a_state_is_one_line(tmp_path, monkeypatch, free, expected):
    """torch.save (optimizer.bin) reports a full disk as RuntimeError "[enforce fail at inline_container.cc:672]
    unexpected pos ..." without its cause: with under 1 MiB left it is a full disk, otherwise a failed write."""
    from library.core import io_utils
    from library.train.observe.disk_space import SaveFailed

    real_save = torch.save

    def broken(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.bin"):
            real_save(obj, f, *args, **kwargs)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 929024 vs 928912")
        return real_save(obj, f, *args, **kwargs)

    def fault():
        monkeypatch.setattr(torch, "save", broken)
        if free is not None:
            monkeypatch.setattr(io_utils, "_free_bytes", lambda folder: free)

    trainer, out = _full_disk_run(tmp_path, fault, ["--save_state"])
    with pytest.raises(SaveFailed) as e:
        trainer.run()
    path = os.path.join(out, "lora-step00000002-state")
    assert re.fullmatch(rf"{re.escape(path)}: {expected}", str(e.value)), str(e.value)
    assert sorted(os.listdir(out)) == ["lora-step00000001-state", "lora-step00000001.safetensors",
                                       "lora-step00000002.safetensors"]


def test_other_write_error_is_one_line(tmp_path, monkeypatch):
    """Any other write failure (here EIO from the LoRA writer) is one line too, the earlier files intact."""
    import errno

    from library.train.observe.disk_space import DiskFull, SaveFailed

    def fault():
        def eio(tensors, filename, metadata=None):
            raise OSError(errno.EIO, "Input/output error", filename)
        import safetensors.torch
        monkeypatch.setattr(safetensors.torch, "save_file", eio)

    trainer, out = _full_disk_run(tmp_path, fault)
    with pytest.raises(SaveFailed) as e:
        trainer.run()
    assert not isinstance(e.value, DiskFull)
    path = os.path.join(out, "lora-step00000002.safetensors")
    assert str(e.value) == (f"{path}: could not be written (Input/output error); nothing was half-written and the "
                            "files saved before are intact; resume with --resume auto once it can be written")
    assert sorted(os.listdir(out)) == ["lora-step00000001.safetensors"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (needs root and mount permission: skipped where it is refused, e.g. in most CI)."""
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("mount is not available")
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


def test_real_full_tmpfs_is_one_line(tmp_path, small_tmpfs, capsys):
    """Issue 22's case on a real 2 MiB tmpfs: the third LoRA save (852,880 bytes each) does not fit."""
    data = make_dataset(str(tmp_path), n=1)
    code = run_training("sd", "test", base_args(data, small_tmpfs, steps=4, extra=["--save_every_n_steps", "1"]))
    err = _error_lines(capsys.readouterr().err)
    path = os.path.join(small_tmpfs, "lora-step00000003.safetensors")
    assert code == 2
    assert len(err) == 1 and re.fullmatch(rf"error: {re.escape(path)}: {_FULL}", err[0]), err
    assert sorted(os.listdir(small_tmpfs)) == ["lora-step00000001.safetensors", "lora-step00000002.safetensors",
                                               "lora_config.toml"]
    assert len(load_file(os.path.join(small_tmpfs, "lora-step00000002.safetensors"))) == 264 * 3
