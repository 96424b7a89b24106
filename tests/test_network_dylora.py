"""--network_module networks.dylora and tools/extract_lora_from_dylora.py on tiny SD 1.x."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.train_helpers import base_args, make_dataset, make_trainer


def outputs(components):
    g = torch.Generator().manual_seed(0)
    te = components.text_encoders[0]
    with torch.no_grad():
        hidden = te(torch.randint(0, te.config.vocab_size - 2, (1, 77), generator=g)).last_hidden_state
        return components.denoiser(torch.randn(1, 4, 8, 8, generator=g), torch.tensor([500]), hidden).sample


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("dylora")
    data = make_dataset(str(root), n=1)
    trainer = make_trainer(base_args(data, str(root / "dy"), steps=3, extra=[
        "--network_module", "networks.dylora", "--network_dim", "8", "--network_args", "unit=4",
        "--learning_rate", "1e-2"]))
    path = trainer.run()
    trainer.accelerator.unwrap_model(trainer.network).eval()
    want = outputs(trainer.components)
    plain = make_trainer(base_args(data, str(root / "lora"), steps=1, extra=["--network_dim", "8"])).run()
    return path, want, plain


def test_dylora_file_has_the_lora_layout_and_records_its_module(trained):
    """sd-scripts' DyLoRANetwork targets lora.py's modules and saves lora_down / lora_up / alpha (its state_dict
    concatenates the rank rows), so the file is keyed and shaped exactly as a networks.lora file of that rank."""
    path, _, plain = trained
    with safe_open(path, framework="pt") as f, safe_open(plain, framework="pt") as g:
        assert {k: f.get_slice(k).get_shape() for k in f.keys()} == {k: g.get_slice(k).get_shape() for k in g.keys()}
        assert len(list(f.keys())) == 792
        assert f.metadata()["ss_network_module"] == "networks.dylora"
        assert f.metadata()["ss_network_dim"] == "8"


def test_dylora_file_reloads_strictly_with_the_trained_output(trained, tiny_sd1_copy):
    from networks import dylora

    path, want, _ = trained
    c = tiny_sd1_copy
    base = outputs(c)
    network, weights = dylora.create_network_from_weights(1.0, path, c.vae, c.text_encoders[0], c.denoiser,
                                                          for_inference=True)
    network.apply_to(c.text_encoders[0], c.denoiser)
    info = network.load_state_dict(load_file(path), strict=True)
    assert (info.missing_keys, info.unexpected_keys) == ([], [])
    got = outputs(c)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, base)
    network.restore()
    network.merge_to(c.text_encoders[0], c.denoiser, load_file(path))
    torch.testing.assert_close(outputs(c), want, rtol=1e-4, atol=1e-5)


def test_a_training_step_moves_only_one_unit_of_rows():
    from networks.dylora import DyLoRAModule

    layer = torch.nn.Linear(6, 5)
    module = DyLoRAModule("lora_unet_x", layer, lora_dim=8, alpha=8, unit=2)
    module.apply_to()
    with torch.no_grad():
        for row in module.lora_B:
            row.normal_()
    random.seed(3)
    layer(torch.randn(4, 6)).square().sum().backward()
    moved = [i for i, row in enumerate(module.lora_A) if row.grad is not None and row.grad.abs().sum() > 0]
    assert len(moved) == 2 and moved[0] % 2 == 0 and moved[1] == moved[0] + 1


def test_extract_writes_each_rank_prefix(trained, tmp_path, capsys):
    from tools.extract_lora_from_dylora import main

    path, _, _ = trained
    out = str(tmp_path / "cut.safetensors")
    assert main(["--model", path, "--save_to", out, "--unit", "4"]) == 0
    assert capsys.readouterr().out == f"saved {tmp_path / 'cut-0004.safetensors'}: rank 4\n"
    src, cut = load_file(path), load_file(str(tmp_path / "cut-0004.safetensors"))
    assert cut.keys() == src.keys()
    for k, v in cut.items():
        want = src[k][:4] if k.endswith("lora_down.weight") else src[k][:, :4] if k.endswith("lora_up.weight") \
            else src[k]
        assert torch.equal(v, want), k
    with safe_open(str(tmp_path / "cut-0004.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_network_dim"] == "4"
        assert f.metadata()["ss_training_comment"].startswith("split from DyLoRA, rank 8 to 4; ")
    assert main(["--model", path, "--save_to", out, "--unit", "8"]) == 2
    assert capsys.readouterr().err == "error: --unit: expected a value below the file's rank 8, got 8\n"
