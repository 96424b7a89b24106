"""Differential output preservation. A subset with custom_attributes.diff_output_preservation = true
(sd-scripts' train_network.py) trains towards the base model's own prediction (the LoRA at multiplier 0) on its
captions, typically the class prompt without the trigger word."""

import os
import shutil

import torch
from safetensors.torch import load_file

import library.train.loop as loop_module
from tests.train_helpers import base_args, make_dataset, make_trainer


def _dataset_config(tmp_path, preserve: bool) -> str:
    trigger = make_dataset(str(tmp_path / "a"), n=2)  # captions "sks toy, ..."
    klass = str(tmp_path / "class")
    shutil.copytree(os.path.join(trigger, "5_sks toy"), klass)
    for name in os.listdir(klass):
        if name.endswith(".txt"):
            with open(os.path.join(klass, name), "w") as f:
                f.write("toy")  # the class prompt
    path = tmp_path / "data.toml"
    path.write_text(f"""
[general]
caption_extension = ".txt"
[[datasets]]
resolution = 64
batch_size = 2
[[datasets.subsets]]
image_dir = "{os.path.join(trigger, '5_sks toy')}"
[[datasets.subsets]]
image_dir = "{klass}"
custom_attributes = {{ diff_output_preservation = {str(preserve).lower()} }}
""")
    return str(path)


def _run(tmp_path, preserve: bool, monkeypatch, family: str = "sd", preset: str = "tiny:sd1", extra=()):
    seen = []
    real = loop_module.batch_loss

    def recording(ctx, batch, generator):
        mean, per_sample = real(ctx, batch, generator)
        flags = batch.get("diff_output_preservation")
        seen.append((per_sample.detach().flatten().clone(),
                     flags.clone() if flags is not None else torch.zeros(len(batch["captions"]), dtype=torch.bool),
                     list(batch["captions"])))
        return mean, per_sample

    monkeypatch.setattr(loop_module, "batch_loss", recording)
    argv = base_args("unused", str(tmp_path / f"out{int(preserve)}"), preset=preset, steps=3, extra=list(extra))
    i = argv.index("--train_data_dir")
    del argv[i:i + 2]
    trainer = make_trainer(argv + ["--dataset_config", _dataset_config(tmp_path / f"d{int(preserve)}", preserve)],
                           family)
    path = trainer.run()
    return load_file(path), seen


def test_dop_targets_the_base_prediction(tmp_path, monkeypatch):
    with_dop, seen = _run(tmp_path, True, monkeypatch)
    without, seen_plain = _run(tmp_path, False, monkeypatch)
    # step 1: the LoRA adds nothing yet, so the marked samples' prediction is the base one: loss exactly 0
    losses, flags, captions = seen[0]
    assert flags.any(), captions
    assert losses[flags].tolist() == [0.0] * int(flags.sum())
    assert bool((losses[~flags] > 0).all()) if (~flags).any() else True
    assert all(c == "toy" for c, f in zip(captions, flags.tolist()) if f)
    # the same run without the key: the class samples train towards the noise, and the weights differ
    assert not seen_plain[0][1].any() and bool((seen_plain[0][0] > 0).all())
    assert with_dop.keys() == without.keys()
    assert any(not torch.equal(with_dop[k], without[k]) for k in with_dop)


def test_dop_on_flux_marked_loss_is_zero_at_step_1(tmp_path, monkeypatch):
    """The same on FLUX.1 (flow matching: the target in the model's own prediction space)."""
    _, seen = _run(tmp_path, True, monkeypatch, "flux", "tiny:flux", ["--t5xxl_max_token_length", "8"])
    losses, flags, _ = seen[0]
    assert flags.any() and losses[flags].tolist() == [0.0] * int(flags.sum())
