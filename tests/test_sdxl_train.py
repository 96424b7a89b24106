"""SDXL LoRA training end to end on the tiny model (both on-disk layouts), the text-encoder cache, bad inputs."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.cli.entry import run_training
from library.core.errors import ConfigError
from library.data.captions import CaptionSettings
from library.data.te_cache import (
    build_text_cache,
    check_text_cache_allowed,
    te_cache_path,
)
from tests.train_helpers import base_args, make_dataset, make_trainer

UNET, TE1, TE2 = 722, 72, 192


@pytest.fixture
def single_file(tiny_sdxl_file):
    """tiny:sdxl written by write_sdxl_preset as one SGM file."""
    return tiny_sdxl_file


def test_train_unet_only_from_sgm_file_with_cached_text(tmp_path, single_file):
    data = make_dataset(str(tmp_path), n=2)
    out = str(tmp_path / "out")
    trainer = make_trainer(base_args(data, out, preset=single_file, steps=2, extra=[
        "--network_train_unet_only", "--cache_text_encoder_outputs_to_disk", "--bucket_reso_steps", "32"]), "sdxl")
    final = trainer.run()
    sd = load_file(final)
    assert len(sd) == UNET * 3 and all(k.startswith("lora_unet_") for k in sd)
    assert "lora_unet_output_blocks_5_1_transformer_blocks_1_attn2_to_k.lora_up.weight" in sd
    with safe_open(final, "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert meta["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    caches = sorted(os.path.basename(p) for p in glob.glob(os.path.join(data, "*", "*_te_outputs.npz")))
    assert caches == ["img0_te_outputs.npz", "img1_te_outputs.npz"]
    with np.load(glob.glob(os.path.join(data, "*", "img0_te_outputs.npz"))[0]) as npz:
        shapes = {k: npz[k].shape for k in ("hidden_state1", "hidden_state2", "pool2")}
    assert shapes == {"hidden_state1": (77, 32), "hidden_state2": (77, 64), "pool2": (64,)}


def test_train_both_text_encoders_from_diffusers_folder(tmp_path, tiny_sdxl_folder):
    folder = tiny_sdxl_folder  # written by write_sdxl_preset
    data = make_dataset(str(tmp_path), n=1)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), preset=folder, steps=2, extra=[
        "--text_encoder_lr", "1e-4", "--unet_lr", "1e-3"]), "sdxl")
    sd = load_file(trainer.run())
    assert len(sd) == (UNET + TE1 + TE2) * 3
    assert sum(k.startswith("lora_te1_") for k in sd) == TE1 * 3
    assert sum(k.startswith("lora_te2_") for k in sd) == TE2 * 3
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.startswith("lora_te2_") and "lora_up" in k)


def _fake_encoder(calls):
    def encode(captions):
        calls.extend(captions)
        n = len(captions)
        values = torch.tensor([float(len(c)) for c in captions])
        return {"hidden_state1": values[:, None, None].expand(n, 77, 3).clone(),
                "hidden_state2": values[:, None, None].expand(n, 77, 5).clone(), "pool2": values[:, None].expand(n, 5).clone()}
    return encode


def test_text_cache_reused_only_while_settings_match(tmp_path):
    images = [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    items = list(zip(images, ["red cat", "blue dog!"]))
    calls: list[str] = []
    kw = dict(model_id="m1", max_token_length=None, suffix="_te_outputs.npz", to_disk=True, batch_size=2)
    cache = build_text_cache(items, _fake_encoder(calls), **kw)
    assert calls == ["", "red cat", "blue dog!"]  # "" probes the shapes
    assert cache["blue dog!"]["pool2"].tolist() == [9.0] * 5
    assert os.path.isfile(te_cache_path(images[0], "_te_outputs.npz"))
    with np.load(str(tmp_path / "a_te_outputs.npz")) as npz:
        assert sorted(npz.files) == ["cache_settings", "hidden_state1", "hidden_state2", "pool2"]
        assert npz["hidden_state1"].dtype == np.float32

    calls.clear()
    build_text_cache(items, _fake_encoder(calls), **kw)
    assert calls == [""]  # both files valid: nothing re-encoded

    calls.clear()
    build_text_cache([(images[0], "red cat, sitting")], _fake_encoder(calls), **kw)
    assert calls == ["", "red cat, sitting"]  # caption changed: rebuilt

    calls.clear()
    build_text_cache(items, _fake_encoder(calls), **kw)
    assert calls == ["", "red cat"]  # a.png's file held the other caption; b.png's is still valid

    np.savez(str(tmp_path / "b_te_outputs.npz"), hidden_state1=np.zeros((77, 3), np.float32))
    calls.clear()
    build_text_cache(items, _fake_encoder(calls), **kw)
    assert calls == ["", "blue dog!"]  # a foreign/damaged file is replaced

    calls.clear()
    build_text_cache(items, _fake_encoder(calls), **{**kw, "max_token_length": 150})
    assert calls == ["", "red cat", "blue dog!"]  # other token length: rebuilt


def test_text_cache_refused_with_random_captions_or_text_encoder_training():
    with pytest.raises(ConfigError, match="network_train_unet_only"):
        check_text_cache_allowed([("subset 0", CaptionSettings())], train_text_encoder=True)
    for settings, flag in ((CaptionSettings(shuffle_caption=True), "shuffle_caption"),
                           (CaptionSettings(caption_dropout_rate=0.1), "caption_dropout_rate"),
                           (CaptionSettings(token_warmup_step=10), "token_warmup_step")):
        with pytest.raises(ConfigError, match=f"subset 1 sets {flag}"):
            check_text_cache_allowed([("subset 0", CaptionSettings()), ("subset 1", settings)], False)


def test_cli_errors_are_one_line_and_before_training(tmp_path, capsys, tiny_sd1_file):
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    args = base_args(data, out, preset="tiny:sdxl", steps=1,
                     extra=["--cache_text_encoder_outputs", "--shuffle_caption", "--network_train_unet_only"])
    assert run_training("sdxl", "t", args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --cache_text_encoder_outputs: subset 0") and "\n" not in err

    sd1 = tiny_sd1_file  # written by write_preset
    assert run_training("sdxl", "t", base_args(data, out, preset=sd1, steps=1)) == 2
    err = capsys.readouterr().err.strip()
    assert "SD 1.x/2.x checkpoint" in err and "use train_network.py" in err and "\n" not in err
    assert not glob.glob(os.path.join(out, "*.safetensors"))


def test_diffusers_named_network_weights_are_converted(tmp_path, tiny_sdxl):
    from library.families import get_family
    from library.train.adapters.network_setup import load_network_weights
    from networks import lora

    c = tiny_sdxl
    family = get_family("sdxl")
    net = lora.create_network(1.0, 4, 4, None, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
    up = torch.full((64, 4), 0.5)
    path = str(tmp_path / "diffusers_named.safetensors")
    save_file({"lora_unet_down_blocks_1_attentions_0_proj_in.lora_up.weight": up,
               "lora_unet_down_blocks_1_attentions_0_proj_in.lora_down.weight": torch.ones(4, 64),
               "lora_unet_down_blocks_1_attentions_0_proj_in.alpha": torch.tensor(2.0)}, path)
    load_network_weights(net, family, path)
    module = dict((m.lora_name, m) for m in net.unet_loras)["lora_unet_input_blocks_4_1_proj_in"]
    assert torch.equal(module.lora_up.weight, up)
    assert module.scale == 0.5


def test_cache_text_encoder_outputs_trains_unet_only_by_default(tmp_path, caplog):
    """The README's SDXL command (--cache_text_encoder_outputs, no --network_train_unet_only)
    is accepted: the UNet trains alone, said once; with --text_encoder_lr the cache is still refused."""
    import logging

    from library.cli.config_file import parse_with_config_file
    from library.cli.entry import build_parser, settings_from_args
    from library.families import get_family

    family = get_family("sdxl")
    data = make_dataset(str(tmp_path), n=1)
    args = base_args(data, str(tmp_path / "out"), preset="tiny:sdxl", steps=1,
                     extra=["--cache_text_encoder_outputs"])
    with caplog.at_level(logging.INFO):
        settings = settings_from_args(parse_with_config_file(build_parser("t", family), args), family)
    assert settings.network.train_unet and not settings.network.train_text_encoder
    assert sum("training the UNet only" in r.getMessage() for r in caplog.records) == 1
    check_text_cache_allowed([("subset 0", CaptionSettings())], settings.network.train_text_encoder)

    ns = parse_with_config_file(build_parser("t", family), args + ["--text_encoder_lr", "1e-5"])
    assert settings_from_args(ns, family).network.train_text_encoder  # asked for: refused before the scan
    flux = get_family("flux")
    ns = parse_with_config_file(build_parser("t", flux), base_args(data, str(tmp_path / "o"), preset="tiny:flux",
                                                                 extra=["--cache_text_encoder_outputs"]))
    assert settings_from_args(ns, flux).network.train_text_encoder  # FLUX.1: CLIP-L trains, T5 is cached
