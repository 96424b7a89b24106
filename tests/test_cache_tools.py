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
    monkeypatch.setattr(trainer.family, "encode_images", lambda vae, x, *more: encoded.append(len(x)) or original(vae, x, *more))
    trainer.run()
    assert encoded == []  # every latent came from the cache written by the tool


def test_cache_latents_tool_reports_bad_input(tmp_path, capsys):
    code = cache_latents.main(["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir",
                               str(tmp_path / "nope"), "--resolution", "64"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: --train_data_dir: no images found")


def test_cache_text_encoder_outputs_tool_then_sdxl_training_never_encodes(tmp_path, monkeypatch):
    from tools import cache_text_encoder_outputs

    data = make_dataset(str(tmp_path), n=2)
    args = base_args(data, str(tmp_path / "out"), preset="tiny:sdxl", steps=2, extra=[
        "--network_train_unet_only", "--bucket_reso_steps", "32",
        "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk"])
    assert cache_text_encoder_outputs.main(["--sdxl"] + args) == 0
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(data, "*", "*.npz")))
    assert files == ["img0_te_outputs.npz", "img1_te_outputs.npz"]

    import library.train.text_caching as text_caching

    trainer = make_trainer(args, "sdxl")
    encoded = []
    original = text_caching.encode_captions
    monkeypatch.setattr(text_caching, "encode_captions", lambda ctx, captions, *a: encoded.append(captions) or
                        original(ctx, captions, *a))
    te_calls = []
    encode_text = trainer.family.encode_text
    monkeypatch.setattr(trainer.family, "encode_text", lambda *a, **k: te_calls.append(1) or encode_text(*a, **k))
    final = trainer.run()
    assert os.path.basename(final) == "lora.safetensors"
    # Only the empty caption build_text_cache encodes to learn the output shapes; every real caption's
    # outputs came from the files the tool wrote, and training steps never ran the text encoders.
    assert encoded == [[""]]
    assert len(te_calls) == 1


def test_cache_text_encoder_outputs_tool_refuses_sd1(tmp_path, capsys):
    from tools import cache_text_encoder_outputs

    data = make_dataset(str(tmp_path), n=1)
    assert cache_text_encoder_outputs.main(base_args(data, str(tmp_path / "out"))) == 2
    assert capsys.readouterr().err.strip() == (
        "error: sd: this model family has no text-encoder output cache; pass --sdxl or --flux")
