"""The default speed-ups (library/train/speedups.py) give the plain path's numbers, and each opt-out turns its
speed-up off: channels_last convolution weights, the automatic text-encoder output cache."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from library.objectives.losses import LossOptions
from library.objectives.noise import NoiseOptions
from library.train.speedups import SpeedOptions, auto_text_cache_blocked, frozen_convs_channels_last
from library.train.step import StepContext, batch_loss
from tests.train_helpers import base_args, make_dataset, make_trainer


def _lora_grads(family, comps, unet, latents, hidden):
    from networks import lora

    torch.manual_seed(0)
    net = lora.create_network(1.0, 4, 4, None, [], unet, lora_targets=family.lora_targets(comps))
    net.apply_to([], unet, False, True)
    for m in net.unet_loras:  # non-zero up weights: the LoRA path is part of the output
        torch.nn.init.normal_(m.lora_up.weight, std=0.1)
    try:
        pred = unet(latents, torch.tensor([500]), hidden).sample
        loss = pred.square().mean()
        loss.backward()
        return pred.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}
    finally:
        net.restore() if hasattr(net, "restore") else None


def test_channels_last_stores_only_frozen_convs_and_gives_the_same_step(tiny_sd1_copy):
    from library.families import get_family

    family, comps = get_family("sd"), tiny_sd1_copy
    unet = comps.denoiser
    unet.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 16, 16, generator=g)
    hidden = torch.randn(1, 77, comps.text_encoders[0].config.hidden_size, generator=g)
    plain_pred, plain_grads = _lora_grads(family, comps, unet, latents, hidden)
    convs_3x3 = [m for m in unet.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)]

    assert frozen_convs_channels_last(unet) == len(convs_3x3) == 52  # the tiny UNet's 3x3 convolutions
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs_3x3)
    assert frozen_convs_channels_last(unet) == 0  # already done
    fast_pred, fast_grads = _lora_grads(family, comps, unet, latents, hidden)
    # Measured: max |diff| 1e-7 (output) and 3e-8 (gradients, |g| up to 4e-3): float rounding of another
    # summation order in the convolution kernels.
    assert torch.allclose(fast_pred, plain_pred, rtol=0, atol=1e-5)
    assert fast_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        assert torch.allclose(fast_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6), name


def test_channels_last_leaves_trained_convs_as_they_are():
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 8, 3))
    model[0].requires_grad_(False)
    assert frozen_convs_channels_last(model) == 1
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    assert model[1].weight.is_contiguous()  # trains: optimizer states and saved files keep their layout


def test_auto_text_cache_reasons_to_stay_off():
    on = SpeedOptions()
    assert auto_text_cache_blocked(on, False, False, [None, None], 1) is None
    assert auto_text_cache_blocked(SpeedOptions(auto_text_cache=False), False, False, [], 1) == "--no_auto_text_cache"
    assert auto_text_cache_blocked(on, True, False, [], 1) == "--cache_text_encoder_outputs"
    assert auto_text_cache_blocked(on, False, True, [], 1) == "a text encoder trains"
    assert auto_text_cache_blocked(on, False, False, [None, "shuffle_caption"], 1) == \
        "shuffle_caption changes captions between steps"
    assert auto_text_cache_blocked(on, False, False, [], 0) == "no text encoder"


def test_filled_cache_gives_the_same_loss_as_encoding(tiny_sd1):
    from library.families import get_family

    family = get_family("sd")
    common = dict(family=family, components=tiny_sd1, scheme=family.noise_scheme(tiny_sd1), noise=NoiseOptions(),
                  loss=LossOptions(), device=torch.device("cpu"), weight_dtype=torch.float32, clip_skip=None,
                  max_token_length=None, train_text_encoder=False, autocast=contextlib.nullcontext)
    plain, cached = StepContext(**common), StepContext(**common, text_cache={}, fill_text_cache=True)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    for captions in (["a red toy", "a blue toy"], ["a blue toy", "a green toy"], ["a red toy", "a red toy"]):
        batch = {"latents": latents, "captions": captions, "loss_weights": torch.ones(2), "masks": None}
        with torch.no_grad():
            a, _ = batch_loss(plain, batch, torch.Generator().manual_seed(2))
            b, _ = batch_loss(cached, batch, torch.Generator().manual_seed(2))
        # a caption encoded alone or beside another gives the same bits here (padded to 77 tokens, one thread)
        assert torch.equal(a, b), captions
    assert sorted(cached.text_cache) == ["a blue toy", "a green toy", "a red toy"]
    assert cached.text_cache["a red toy"]["hidden"].shape[0] == 77 if "hidden" in cached.text_cache["a red toy"] \
        else True


def _train(tmp_path, name, extra, caplog):
    data = make_dataset(str(tmp_path), n=2)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer = make_trainer(base_args(data, str(tmp_path / name), steps=4,
                                         extra=["--network_train_unet_only", *extra]))
        final = trainer.run()
    return trainer, load_file(final), caplog.text


def test_default_run_caches_text_and_uses_channels_last_with_the_plain_result(tmp_path, caplog):
    fast, fast_lora, fast_log = _train(tmp_path, "fast", [], caplog)
    assert "text encoders are frozen and captions fixed: each caption's outputs are kept in memory" in fast_log
    assert "(2 captions," in fast_log
    assert "channels_last: 52 frozen convolutions of the denoiser stored NHWC" in fast_log
    assert "fused LoRA products: 192 LoRA modules compute their update with the frozen layer's product" in fast_log
    assert sorted(fast.ctx.text_cache) == ["sks toy, square, color 0, plain background",
                                          "sks toy, square, color 1, plain background"]

    plain, plain_lora, plain_log = _train(tmp_path, "plain", ["--no_auto_text_cache", "--no_channels_last",
                                                              "--no_fused_lora"], caplog)
    assert "kept in memory" not in plain_log and "channels_last" not in plain_log and "fused LoRA" not in plain_log
    assert plain.ctx.text_cache is None and not plain.ctx.fill_text_cache
    assert fast_lora.keys() == plain_lora.keys()
    # The cache itself is bitwise (test above); channels_last rounds the convolutions differently (1e-7), the
    # fused LoRA products their sums (3e-7, tests below), and AdamW divides each gradient by its own running size,
    # so an element whose gradient is near 0 can step differently by up to the learning rate (1e-3). Measured:
    # max |diff| 3e-4 over 4 steps, global relative difference of all weights 5e-6 (cache and channels_last);
    # with the fused products too, 4.3e-5 and 1.6e-6 in another run.
    for k in plain_lora:
        assert torch.allclose(fast_lora[k], plain_lora[k], rtol=0, atol=1e-3), k
    diff = torch.cat([(fast_lora[k] - plain_lora[k]).flatten() for k in plain_lora]).norm()
    assert diff / torch.cat([v.flatten() for v in plain_lora.values()]).norm() < 5e-5


_BF16_RUNS = """
import json, os, sys
import torch
from safetensors.torch import load_file
import networks.lora_module as lora_module
from tests.train_helpers import base_args, make_dataset, make_trainer

calls = [0]
real = lora_module.lora_linear
def counted(*args, **kwargs):
    calls[0] += 1
    return real(*args, **kwargs)
lora_module.lora_linear = counted
root = sys.argv[1]
data = make_dataset(root, n=2)
runs = {}
for name, extra in (("fused", []), ("plain", ["--no_fused_lora"])):
    calls[0] = 0
    trainer = make_trainer(base_args(data, os.path.join(root, name), steps=4, extra=[
        "--network_train_unet_only", "--mixed_precision", "bf16", *extra]))
    runs[name] = (load_file(trainer.run()), calls[0])
(fused, fused_calls), (plain, plain_calls) = runs["fused"], runs["plain"]
diff = torch.cat([(fused[k].float() - plain[k].float()).flatten() for k in plain]).norm()
size = torch.cat([plain[k].float().flatten() for k in plain]).norm()
print(json.dumps({"fused_calls": fused_calls, "plain_calls": plain_calls, "keys": sorted(fused) == sorted(plain),
                  "max_abs": max(float((fused[k].float() - plain[k].float()).abs().max()) for k in plain),
                  "relative": float(diff / size)}))
"""


def test_a_bf16_autocast_run_with_fused_products_is_the_plain_run_within_bf16_rounding(tmp_path):
    """--mixed_precision bf16 (CPU autocast): the fused products run in autocast's dtype, in the real loop. In a
    fresh process: accelerate keeps one mixed-precision setting per process."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _BF16_RUNS, str(tmp_path)], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["fused_calls"] > 0 and got["plain_calls"] == 0 and got["keys"]
    # 4 AdamW steps (lr 1e-3) of bfloat16 products rounded in other places. Measured: max |diff| 3.0e-3, relative
    # 1.1e-3 of the LoRA's size; for scale, the same plain run in bf16 against float32: 5.8e-3 and 3.1e-3 (and the
    # fused bf16 run against float32: 5.8e-3, 3.2e-3, as close as the plain one).
    assert got["max_abs"] < 1e-2 and got["relative"] < 3e-3, got


def test_random_captions_keep_encoding_every_step(tmp_path, caplog):
    trainer, _, log = _train(tmp_path, "shuffled", ["--shuffle_caption"], caplog)
    assert "text encoder outputs are computed every step (shuffle_caption changes captions between steps)" in log
    assert trainer.ctx.text_cache is None


def _lora_linear(fused: bool, dtype=torch.float32, dropout=None, bias=True):
    from networks.lora_module import LoRAModule

    torch.manual_seed(0)
    org = torch.nn.Linear(48, 80, bias=bias).to(dtype).requires_grad_(False)
    lora = LoRAModule("lora_unet_x", org, multiplier=0.7, lora_dim=8, alpha=4, dropout=dropout)  # float32 LoRA
    torch.nn.init.normal_(lora.lora_up.weight, std=0.05)  # zero at init: give the update a size
    lora.apply_to()
    lora.fused_matmul = fused
    return org, lora


def _forward_backward(org, lora, x):
    x = x.clone().requires_grad_(True)
    out = org(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return out.detach(), x.grad, lora.lora_down.weight.grad, lora.lora_up.weight.grad, out.grad_fn


def _relative_differences(dtype, rows):
    x = torch.randn(rows, 48).to(dtype)
    plain = _forward_backward(*_lora_linear(False, dtype), x)
    fused = _forward_backward(*_lora_linear(True, dtype), x)
    assert type(fused[4]).__name__ == "_LoRALinearBackward" and type(plain[4]).__name__ == "AddBackward0"
    return [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(plain[:4], fused[:4])]


@pytest.mark.parametrize("rows", [59, 60])  # merging pays from 60 rows here (pays(): 2 * 48 * 80 / 128)
def test_fused_lora_linear_is_the_plain_formula_in_float32(rows):
    from networks.lora_matmul import pays

    assert pays(rows, 48, 80) == (rows == 60)
    # The same sums rounded in another order (a merged weight is rounded once, the scale multiplies the LoRA
    # gradients last). Measured, relative to the largest value, output / input gradient / down / up: merged
    # (60 rows) 2.6e-7 / 3.2e-7 / 3.2e-7 / 1.2e-6; fused (59 rows) 5.5e-8 / 5.3e-8 / 2.7e-7 / 4.5e-7.
    assert max(_relative_differences(torch.float32, rows)) < 5e-6


def test_fused_lora_linear_on_a_bfloat16_base_is_the_plain_formula_rounded_once():
    # The update is computed in the LoRA's float32 either way; the plain path rounds the scaled update to bfloat16
    # and then the sum, the fused one only the sum: at most one bfloat16 step (2^-8) apart. Measured: output 3.6e-3,
    # input gradient 3.4e-3 of the largest value; down and up (float32 products of the same bfloat16 gradient)
    # 2.3e-7 and 4.3e-7.
    out, grad_x, down, up = _relative_differences(torch.bfloat16, 64)
    assert out < 8e-3 and grad_x < 8e-3 and down < 5e-6 and up < 5e-6


# Under autocast both paths run their products in autocast's dtype; they round in different places (the plain
# path rounds the LoRA's product, its scaled copy and the sum; the fused one the product with the scale and the sum
# in the epilogue). Measured, relative to the largest value, output / input gradient / down / up, for every base
# dtype (float32, bfloat16, float16) and input dtype (float32, autocast's): bfloat16 3.4e-3 / 3.4e-3 / 3.2e-3 /
# 6.1e-3, float16 4.2e-4 / 4.3e-4 / 4.0e-4 / 7.7e-4, under 2 steps of the dtype (2^-8, 2^-11); against a float32
# run both paths are as close (bfloat16, up's gradient: plain 1.3e-2, fused 1.1e-2).
AUTOCAST_BOUND = {torch.bfloat16: 2 * 2 ** -8, torch.float16: 2 * 2 ** -11}


@pytest.mark.parametrize("base", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
def test_fused_lora_linear_under_autocast_is_the_plain_formula_in_its_dtype(autocast, base):
    results = []
    for fused in (False, True):
        org, lora = _lora_linear(fused, base)
        x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).requires_grad_(True)  # a float32 input
        with torch.autocast("cpu", dtype=autocast):
            out = org(x)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
        results.append((out.detach(), x.grad, lora.lora_down.weight.grad, lora.lora_up.weight.grad, out.grad_fn))
    plain, fused = results
    assert type(plain[4]).__name__ == "AddBackward0" and type(fused[4]).__name__ == "_LoRALinearBackward"
    assert plain[0].dtype == fused[0].dtype == autocast
    assert fused[1].dtype == torch.float32 and fused[2].dtype == fused[3].dtype == torch.float32  # as the plain path
    for a, b in zip(fused[:4], plain[:4]):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < AUTOCAST_BOUND[autocast]


@pytest.mark.parametrize("case", ["dropout", "module_off"])
def test_fused_lora_linear_keeps_the_plain_formula_where_it_is_not_the_same(case):
    org, lora = _lora_linear(case != "module_off", dropout=0.1 if case == "dropout" else None)
    lora.train()
    x = torch.randn(64, 48, requires_grad=True)
    out = org(x)
    assert type(out.grad_fn).__name__ != "_LoRALinearBackward"
    lora.eval()  # dropout applies only in training
    assert type(org(x).grad_fn).__name__ == ("AddBackward0" if case == "module_off" else "_LoRALinearBackward")


def test_merging_needs_full_float32_products():
    from networks.lora_matmul import merges

    org, _ = _lora_linear(True)
    x = torch.randn(64, 48)
    assert merges(x, org.weight) and not merges(x.bfloat16(), org.weight.bfloat16())
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # products may round to TF32 / bfloat16: a merged update would too
    try:
        assert not merges(x, org.weight)
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True])
def test_fused_qkv_lora_adds_each_update_in_place_as_the_plain_formula(dtype, split):
    from networks.lora_fused import FusedLoRAModule

    def run(fused):
        torch.manual_seed(0)
        projections = [torch.nn.Linear(48, 40).to(dtype).requires_grad_(False) for _ in range(3)]
        lora = FusedLoRAModule("lora_unet_qkv", projections, multiplier=0.7, lora_dim=6, alpha=3, split=split)
        torch.nn.init.normal_(lora.lora_up.weight, std=0.05)
        lora.apply_to()
        lora.fused_matmul = fused
        x = torch.randn(2, 17, 48).to(dtype).requires_grad_(True)
        outs = [p(x) for p in projections]
        names = {type(o.grad_fn).__name__ for o in outs}
        sum((o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        return [torch.cat([o.detach().float().flatten() for o in outs]), x.grad.float(),
                lora.lora_down.weight.grad, lora.lora_up.weight.grad], names

    plain, plain_ops = run(False)
    fused, fused_ops = run(True)
    assert plain_ops == {"AddBackward0"} and fused_ops == {"ViewBackward0"}  # the in-place sum, viewed back
    # float32: the update is added in the product's epilogue; measured, of the largest value, outputs 5.3e-8, input
    # gradient 5.5e-8, down 1.7e-7, up 4.1e-7. bfloat16: the sum is rounded once instead of twice, and backward
    # scales the output's gradient in bfloat16 before the LoRA's float32 products (a bfloat16 step, 2^-8, at most);
    # measured outputs 3.5e-3, input gradient 3.6e-3, down 1.5e-3, up 3.0e-3.
    bound = 1e-6 if dtype == torch.float32 else 8e-3
    for a, b in zip(plain, fused):
        assert (a - b).abs().max() <= bound * b.abs().max()


def test_fused_lora_conv_adds_its_update_in_place_as_the_plain_formula():
    from networks.lora_module import LoRAModule

    def run(fused):
        torch.manual_seed(0)
        org = torch.nn.Conv2d(16, 24, 1).requires_grad_(False)
        lora = LoRAModule("lora_unet_proj_in", org, multiplier=0.7, lora_dim=4, alpha=2)
        torch.nn.init.normal_(lora.lora_up.weight, std=0.05)
        lora.apply_to()
        lora.fused_matmul = fused
        x = torch.randn(2, 16, 8, 8, requires_grad=True)
        out = org(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        inputs = sorted(type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None)
        return [out.detach(), x.grad, lora.lora_down.weight.grad, lora.lora_up.weight.grad], inputs

    (plain, plain_ops), (fused, fused_ops) = run(False), run(True)
    assert plain_ops == ["ConvolutionBackward0", "MulBackward0"]  # org(x) + up(down(x)) * scale
    assert fused_ops == ["ConvolutionBackward0", "ConvolutionBackward0"]  # org(x) += scale * up(down(x))
    # the scale applied in the sum instead of to a copy: measured 0 to 6e-8 of the largest value
    for a, b in zip(plain, fused):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["qkv", "qkv_split", "conv"])
def test_in_place_lora_updates_under_autocast_are_the_plain_formula_in_its_dtype(kind, autocast):
    """The fused-qkv slices and a Conv2d's LoRA add their update in place under autocast too, computed in
    autocast's dtype as the plain formula computes it there."""
    from networks.lora_fused import FusedLoRAModule
    from networks.lora_module import LoRAModule

    def run(fused):
        torch.manual_seed(0)
        if kind == "conv":
            layers = [torch.nn.Conv2d(16, 24, 3, padding=1).requires_grad_(False)]
            lora = LoRAModule("lora_unet_conv", layers[0], multiplier=0.7, lora_dim=4, alpha=2)
            x = torch.randn(2, 16, 8, 8)
        else:
            layers = [torch.nn.Linear(48, 40).to(torch.bfloat16).requires_grad_(False) for _ in range(3)]
            lora = FusedLoRAModule("lora_unet_qkv", layers, multiplier=0.7, lora_dim=6, alpha=3,
                                   split=kind == "qkv_split")
        torch.nn.init.normal_(lora.lora_up.weight, std=0.05)
        lora.apply_to()
        lora.fused_matmul = fused
        x = (x if kind == "conv" else torch.randn(2, 17, 48)).requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast):
            outs = [layer(x) for layer in layers]
        assert {o.dtype for o in outs} == {autocast}
        sum((o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        ops = {type(f).__name__ for o in outs for f, _ in o.grad_fn.next_functions if f is not None}
        return [torch.cat([o.detach().float().flatten() for o in outs]), x.grad.float(),
                lora.lora_down.weight.grad, lora.lora_up.weight.grad], ops

    (plain, plain_ops), (fused, fused_ops) = run(False), run(True)
    assert ("MulBackward0" in plain_ops or "ToCopyBackward0" in plain_ops) and "MulBackward0" not in fused_ops
    # The plain path rounds the update's product, its scaled copy and the sum; in place, the product with the scale
    # and the sum. Measured, of the largest value, output / input gradient / down / up: qkv bfloat16 3.4e-3 /
    # 3.6e-3 / 6.0e-3 / 7.6e-3, float16 4.3e-4 / 4.5e-4 / 7.5e-4 / 9.5e-4; conv 2.0e-3 (bfloat16), 4.9e-4
    # (float16) on the output and 0 on the gradients: at most 2 steps of the dtype; bound 4.
    bound = 4 * (2 ** -8 if autocast == torch.bfloat16 else 2 ** -11)
    for a, b in zip(fused, plain):
        assert (a.float() - b.float()).abs().max() <= bound * b.float().abs().max()


def test_channels_last_pays_on_the_cpu_only_for_small_latents():
    from library.train.speedups import channels_last_pays

    cpu = torch.device("cpu")
    assert channels_last_pays(cpu, [(16, 16), (8, 8)])  # 128² images: measured 0.68 against 0.92 without
    assert not channels_last_pays(cpu, [(8, 8), (32, 32)])  # 256²: 0.90 against 0.87 without; the largest decides
    assert not channels_last_pays(cpu, [(64, 64)]) and not channels_last_pays(cpu, [(24, 12)])
    assert channels_last_pays(torch.device("cuda"), [(128, 128)])  # cuDNN: always


def test_channels_last_is_left_off_on_the_cpu_for_large_latents(caplog):
    from library.train.speedups import use_channels_last

    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3)).requires_grad_(False)
    with caplog.at_level(logging.INFO):
        assert use_channels_last(model, SpeedOptions(), torch.device("cpu"), [(64, 64)]) == 0
    assert "channels_last: off on the CPU for 64x64 latents" in caplog.text
    assert model[0].weight.is_contiguous()
    assert use_channels_last(model, SpeedOptions(), torch.device("cpu"), [(16, 16)]) == 1
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
