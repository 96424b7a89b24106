"""The LoRA tools on LyCORIS files trained here (LoKr, LoHa, LoCon + DoRA on tiny SD 1.x): merge, SVD merge,
resize --to_lora, convert, show_metadata and generate.

The reference ΔW of every module is measured, not computed by the code under test: the file is hooked into a
fresh base model by LyCORIS' own loader (lycoris.kohya, as generation does) and each adapted layer is run on the
identity, so ΔWᵀ = layer(I) − base_layer(I).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from tests.train_helpers import base_args, make_dataset, make_trainer

pytest.importorskip("lycoris.kohya")

KINDS = {"lokr": ["algo=lokr"], "loha": ["algo=loha"], "dora": ["algo=locon", "dora_wd=True"],
         "oft": ["algo=diag-oft"]}


def _run(tool, argv):
    return importlib.import_module(f"tools.{tool}").main(argv)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """kind -> a file written by training (2 steps, lr 1e-2, preset attn-mlp) on tiny SD 1.x."""
    root = tmp_path_factory.mktemp("lycoris_tools")
    data = make_dataset(str(root), n=1)
    files = {}
    for kind, args in KINDS.items():
        trainer = make_trainer(base_args(data, str(root / kind), steps=2, extra=[
            "--network_module", "lycoris.kohya", "--learning_rate", "1e-2", "--network_args", *args,
            "preset=attn-mlp"]))
        files[kind] = trainer.run()
    return files


def _layers(components):
    from library.families import get_family
    from tools.lora_models import LoadedModel, lora_layers

    return lora_layers(LoadedModel(get_family("sd"), components))


def _identity_out(layer, n):
    eye = torch.eye(n)
    if isinstance(layer, torch.nn.Conv2d):
        assert tuple(layer.kernel_size) == (1, 1), "the attn-mlp preset adapts Linear and 1x1 convs only"
        return layer(eye[:, :, None, None])[:, :, 0, 0]
    return layer(eye)


def measured_deltas(path, components):
    """module name -> ΔW (float32, the layer's shape) of the file hooked into `components` by LyCORIS."""
    from library.families import get_family
    from library.train.adapters.network_apply import NetworkSpec, apply_networks

    layers = _layers(components)
    names = sorted({k.split(".")[0] for k in load_file(path)})
    with torch.no_grad():
        base = {n: _identity_out(layers[n].module, layers[n].weight.shape[1]) for n in names}
        applied = apply_networks(get_family("sd"), components, [NetworkSpec("lycoris.kohya", path, 1.0)], False,
                                 torch.device("cpu"), torch.float32)
        try:
            return {n: (_identity_out(layers[n].module, layers[n].weight.shape[1]) - base[n]).T
                    .reshape(layers[n].weight.shape) for n in names}
        finally:
            applied.remove()


def _svd_error(dw, rank):
    s = torch.linalg.svdvals(dw.reshape(dw.shape[0], -1).double())
    return float(s[rank:].square().sum().sqrt())


def _lora_delta(state, name):
    from networks.lora_math import delta_weight

    down, up = state[f"{name}.lora_down.weight"].float(), state[f"{name}.lora_up.weight"].float()
    return delta_weight(down, up, state[f"{name}.alpha"])


@pytest.mark.parametrize("kind", list(KINDS))
def test_merge_into_the_model_equals_base_plus_the_measured_delta(kind, trained, tmp_path, tiny_sd1_copy, capsys):
    from tools.lora_models import load_model

    out = str(tmp_path / "merged.safetensors")
    assert _run("merge_lora", ["--sd_model", "tiny:sd1", "--models", trained[kind], "--save_to", out]) == 0
    n = len({k.split(".")[0] for k in load_file(trained[kind])})
    assert capsys.readouterr().out == f"saved {out}: {n} LoRA modules merged into tiny:sd1\n"
    base_layers = _layers(tiny_sd1_copy)
    base = {name: layer.weight.detach().clone() for name, layer in base_layers.items()}
    measured = measured_deltas(trained[kind], tiny_sd1_copy)
    merged_layers = _layers(load_model(out, "sd").components)
    worst = 0.0
    for name, dw in measured.items():
        assert float(dw.norm()) > 0, name  # training moved every module
        got = merged_layers[name].weight.detach() - base[name]
        # in units of float32 rounding at the layer's weight scale: both sides round W + ΔW (and x·Wᵀ + b)
        ulp = torch.finfo(torch.float32).eps * float(base[name].abs().max())
        worst = max(worst, float((got - dw).abs().max()) / ulp)
    print(kind, "worst error in float32 ulps of max|W|:", worst)
    assert worst <= 4, worst  # measured: LoKr 1.0, LoHa 1.41, DoRA 1.0, OFT 1.0
    untouched = [n for n in base if n not in measured]
    assert untouched and all(torch.equal(merged_layers[n].weight, base[n]) for n in untouched)


def test_lokr_delta_is_the_kronecker_product_of_its_factors(trained):
    """One module checked against LoKr's definition, ΔW = (w1 ⊗ w2_a·w2_b) · alpha / rank."""
    from networks.lycoris_delta import load_lycoris_file

    state = load_file(trained["lokr"])
    name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_ff_net_0_proj"
    w2 = state[f"{name}.lokr_w2_a"] @ state[f"{name}.lokr_w2_b"]
    rank = state[f"{name}.lokr_w2_a"].shape[1]
    want = torch.kron(state[f"{name}.lokr_w1"], w2) * float(state[f"{name}.alpha"]) / rank
    got = load_lycoris_file(trained["lokr"]).modules[name].delta()
    assert got.shape == (256, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_svd_merge_is_the_best_approximation_of_the_ratio_sum(kind, trained, tmp_path, tiny_sd1_copy):
    out = str(tmp_path / "svd.safetensors")
    f = trained[kind]
    assert _run("svd_merge_lora", ["--models", f, f, "--ratios", "0.5", "0.25", "--new_rank", "4",
                                   "--save_to", out]) == 0
    state = load_file(out)
    measured = measured_deltas(f, tiny_sd1_copy)
    assert {k.split(".")[0] for k in state} == set(measured)
    for name, dw in measured.items():
        target = 0.75 * dw
        err = float((_lora_delta(state, name).reshape(target.shape) - target).norm())
        best = _svd_error(target, 4)
        assert abs(err - best) <= 1e-4 * float(target.norm()) + 1e-7, (name, err, best)
    with safe_open(out, framework="pt") as fh:
        md = fh.metadata()
    assert md["ss_network_module"] == "networks.lora" and "ss_network_args" not in md
    assert md["ss_network_dim"] == "4"


def test_resize_to_lora_and_convert_to_diffusers_reproduce_delta_within_the_svd_error(trained, tmp_path, tiny_sd1_copy,
                                                                                     capsys):
    from library.families.lora_convert import load_lora_file

    f = trained["lokr"]
    resized, peft = str(tmp_path / "r.safetensors"), str(tmp_path / "peft.safetensors")
    assert _run("resize_lora", ["--model", f, "--new_rank", "3", "--save_to", resized]) == 2
    assert capsys.readouterr().err.startswith(f"error: {f}: lora_te_text_model_encoder_layers_0_mlp_fc1: a LyCORIS "
                                              f"LoKr module; give --to_lora")
    assert _run("resize_lora", ["--model", f, "--new_rank", "3", "--to_lora", "--save_to", resized]) == 0
    assert _run("convert_lora", ["--src_path", f, "--to", "diffusers", "--dst_path", peft]) == 2
    assert "give --new_rank R" in capsys.readouterr().err
    assert _run("convert_lora", ["--src_path", f, "--to", "diffusers", "--new_rank", "3", "--dst_path", peft]) == 0
    assert next(iter(load_file(peft))).startswith(("unet.", "text_encoder."))
    measured = measured_deltas(f, tiny_sd1_copy)
    for path in (resized, peft):
        modules = load_lora_file(path).modules
        assert set(modules) == set(measured)
        for name, dw in measured.items():
            err = float((modules[name].delta().reshape(dw.shape) - dw).norm())
            assert abs(err - _svd_error(dw, 3)) <= 1e-4 * float(dw.norm()) + 1e-7, (path, name)


def test_dora_needs_the_base_model_outside_a_merge(trained, tmp_path, capsys):
    out = str(tmp_path / "o.safetensors")
    assert _run("svd_merge_lora", ["--models", trained["dora"], "--new_rank", "4", "--save_to", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a LyCORIS LoCon+DoRA module: its ΔW depends on the base model's weight" in err
    assert not os.path.exists(out)


def test_dora_to_lora_with_the_base_model(trained, tmp_path, tiny_sd1_copy):
    out = str(tmp_path / "r.safetensors")
    assert _run("resize_lora", ["--model", trained["dora"], "--new_rank", "4", "--to_lora", "--base_model", "tiny:sd1",
                                "--save_to", out]) == 0
    state = load_file(out)
    for name, dw in measured_deltas(trained["dora"], tiny_sd1_copy).items():
        err = float((_lora_delta(state, name).reshape(dw.shape) - dw).norm())
        assert abs(err - _svd_error(dw, 4)) <= 1e-4 * float(dw.norm()) + 1e-7, name


def test_show_metadata_prints_the_kinds(trained, capsys):
    for kind, algo in (("lokr", "LoKr"), ("loha", "LoHa"), ("dora", "DoRA")):
        assert _run("show_metadata", [trained[kind], "--keys"]) == 0
        out = capsys.readouterr().out
        summary = json.loads(out[out.rindex("\n{") + 1:])
        assert summary["layout"] == "lycoris" and summary["algorithms"] == {algo: 266}, summary
        assert summary["network_module"] == "lycoris.kohya"


def test_convert_keeps_lycoris_modules_for_kohya_and_comfy(trained, tmp_path):
    src = load_file(trained["lokr"])
    for to in ("kohya", "comfy"):
        out = str(tmp_path / f"{to}.safetensors")
        assert _run("convert_lora", ["--src_path", trained["lokr"], "--to", to, "--dst_path", out]) == 0
        got = load_file(out)
        assert got.keys() == src.keys() and all(torch.equal(got[k], src[k]) for k in src)


def test_generate_applies_a_lokr_file_hooked_and_merged(trained, tmp_path):
    import glob

    import numpy as np
    from PIL import Image

    from tools import generate as tool

    def gen(name, *extra):
        out = tmp_path / name
        argv = ["--ckpt", "tiny:sd1", "--outdir", str(out), "--prompt", "a red cat", "--device", "cpu", "--seed", "1",
                "--W", "64", "--H", "64", "--steps", "2", "--scale", "4", "--sampler", "euler_a", *extra]
        assert tool.main(argv) == 0
        return np.asarray(Image.open(glob.glob(str(out / "*.png"))[0]).convert("RGB")).astype(int)

    base = gen("base")
    hooked = gen("hooked", "--network_weights", trained["lokr"])  # no --network_module: lycoris.kohya is chosen
    merged = gen("merged", "--network_weights", trained["lokr"], "--merge")
    assert np.abs(hooked - base).max() > 0
    assert np.abs(hooked - merged).max() <= 1  # the same images up to rounding of a pixel value
