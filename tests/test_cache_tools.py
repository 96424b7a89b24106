"""tools/cache_latents.py builds the cache a later training run finds valid."""

from __future__ import annotations

import glob
import os

from tests.train_helpers import base_args, make_dataset, make_trainer
from tools import cache_latents


def test_cache_latents_tool_then_training_reuses_every_entry(tmp_path, monkeypatch):
    data = make_dataset(str(tmp_path), n=2)
    args = base_args(data, str(tmp_path / "out"), steps=1, extra=["--cache_latents", "--cache_latents_to_disk"])
    assert cache_latents.main(args) == 0
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(data, "*", "*.npz")))
    assert files == ["img0_0064x0064_sd.npz", "img1_0128x0064_sd.npz"]

    trainer = make_trainer(args)
    encoded = []
    original = trainer.family.encode_images
    monkeypatch.setattr(trainer.family, "encode_images", lambda vae, x: encoded.append(len(x)) or original(vae, x))
    trainer.run()
    assert encoded == []  # every latent came from the cache written by the tool


def test_cache_latents_tool_reports_bad_input(tmp_path, capsys):
    code = cache_latents.main(["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir",
                               str(tmp_path / "nope"), "--resolution", "64"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: --train_data_dir: no images found")
