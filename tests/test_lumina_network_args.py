"""Lumina's embedder_dims and split_qkv network args (sd-scripts' lora_lumina.py names and counts on the full-size
model, meta device), a tiny run with both, and --model_prediction_type additive / sigma_scaled against sd-scripts'
formulas on the tiny DiT's own output."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.lumina import layout
from library.families.base import Components, LoadOptions, TextConditioning
from library.families.lumina.configs import PRESETS, transformer_config
from library.families.lumina.options import LuminaFlowOptions
from networks.lora import create_network
from tests.train_helpers import base_args, make_dataset, make_trainer

EMBEDDER_FILTERS = ("x_embedder", "t_embedder", "cap_embedder")  # sd-scripts' embedder_dims filters, in order


@pytest.fixture(scope="module")
def full_size():
    from diffusers import Lumina2Transformer2DModel

    with torch.device("meta"):
        return Components(Lumina2Transformer2DModel(**transformer_config(PRESETS["random:lumina2"])), None, [], [])


def _dims(c, **args) -> dict:
    net = create_network(1.0, 4, 8, None, None, None, lora_targets=get_family("lumina").lora_targets(c), **args)
    return {lora.lora_name: lora for lora in net.unet_loras}


def test_full_size_embedder_dims_on_meta(full_size):
    # sd-scripts' rule, from the original file's tensors: every Linear (2-D weight) whose name has a filter
    original = layout.to_original(full_size.denoiser.state_dict())
    expected = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in original.items()
                if k.endswith(".weight") and v.ndim == 2 and any(f in k for f in EMBEDDER_FILTERS)}
    plain = _dims(full_size)
    loras = _dims(full_size, embedder_dims="[2,3,5]")
    assert len(plain) == 180 and len(loras) == 184 and set(loras) - set(plain) == expected
    assert {n: loras[n].lora_dim for n in expected} == {"lora_unet_x_embedder": 2, "lora_unet_t_embedder_mlp_0": 3,
                                                        "lora_unet_t_embedder_mlp_2": 3, "lora_unet_cap_embedder_1": 5}
    assert loras["lora_unet_cap_embedder_1"].lora_down.weight.shape == (5, 2304)  # Gemma-2's width in
    assert loras["lora_unet_x_embedder"].lora_down.weight.shape == (2, 64)  # 2x2 patches of 16 channels
    # as sd-scripts: train_blocks does not filter the embedders, the type dims still apply ("mlp" in t_embedder_mlp)
    typed = _dims(full_size, embedder_dims="[2,0,5]", mlp_dim="16", train_blocks="transformer")
    assert {n: typed[n].lora_dim for n in typed if "embedder" in n} == {
        "lora_unet_x_embedder": 2, "lora_unet_t_embedder_mlp_0": 16, "lora_unet_t_embedder_mlp_2": 16,
        "lora_unet_cap_embedder_1": 5}
    assert len(typed) == 26 * 6 + 4


def test_full_size_split_qkv_on_meta(full_size):
    loras = _dims(full_size, split_qkv="True")
    split = {n for n, lora in loras.items() if getattr(lora, "split", False)}
    assert split == {n for n in loras if n.endswith("_attention_qkv")} and len(split) == 26 + 2 + 2
    qkv = loras["lora_unet_context_refiner_1_attention_qkv"]
    # grouped-query attention: q 2304 rows, k and v 768 each; three rank-4 blocks
    assert (qkv.lora_down.weight.shape, qkv.lora_up.weight.shape) == ((12, 2304), (2304 + 2 * 768, 12))
    assert qkv.out_sizes == [2304, 768, 768] and qkv.scale == pytest.approx(8 / 4)
    assert not getattr(loras["lora_unet_layers_0_attention_out"], "split", False)


@pytest.mark.parametrize("args,error", [
    ({"embedder_dims": "[4,4]"}, "--network_args embedder_dims: expected 3 comma-separated integers >= 0 [x,t,cap], "
                                 "got 2 values"),
    ({"split_qkv": "sure"}, "--network_args split_qkv: expected True or False, got 'sure'"),
])
def test_bad_values_are_one_line_errors(full_size, args, error):
    with pytest.raises(ConfigError, match="^" + re.escape(error)):
        _dims(full_size, **args)


def test_tiny_run_with_split_qkv_embedders_and_sigma_scaled(tmp_path):
    data = make_dataset(str(tmp_path), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:lumina", steps=2, extra=[
        "--network_module", "networks.lora_lumina", "--gemma2_max_token_length", "16", "--cache_text_encoder_outputs",
        "--network_train_unet_only", "--model_prediction_type", "sigma_scaled", "--weighting_scheme", "sigma_sqrt",
        "--network_args", "split_qkv=True", "embedder_dims=[4,4,4]"]), "lumina")
    path = trainer.run()
    sd = load_file(path)
    with safe_open(path, "pt") as f:
        assert f.metadata()["ss_model_prediction_type"] == "sigma_scaled"
    modules = {k.split(".")[0] for k in sd}
    assert {m for m in modules if "embedder" in m} == {"lora_unet_x_embedder", "lora_unet_t_embedder_mlp_0",
                                                       "lora_unet_t_embedder_mlp_2", "lora_unet_cap_embedder_1"}
    assert all(sd[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)  # every module trained
    dit = trainer.components.denoiser
    q, kv = dit.layers[0].attn.to_q.out_features, dit.layers[0].attn.to_k.out_features
    up = sd["lora_unet_layers_0_attention_qkv.lora_up.weight"]
    assert up.shape == (q + 2 * kv, 12) and float(sd["lora_unet_layers_0_attention_qkv.alpha"]) == 12.0
    starts = [0, q, q + kv, q + 2 * kv]
    for i in range(3):
        for j in range(3):
            block = up[starts[i]:starts[i + 1], 4 * j:4 * (j + 1)]
            assert (block.abs().sum() > 0) if i == j else torch.equal(block, torch.zeros_like(block))


@pytest.fixture(scope="module")
def tiny():
    return get_family("lumina").load(LoadOptions("tiny:lumina"))


@pytest.mark.parametrize("kind,weighting", [("raw", "uniform"), ("additive", "uniform"),
                                            ("sigma_scaled", "sigma_sqrt"), ("sigma_scaled", "cosmap")])
def test_prediction_types_give_sd_scripts_loss(tiny, kind, weighting):
    """sd-scripts' lumina_train_network: out = NextDiT(x_σ, 1 − σ), f(out) = out (raw) / out + x_σ (additive) /
    x_σ − σ·out (sigma_scaled, weighted by the scheme: σ^-2 or 2 / (π(1 − 2σ + 2σ²))), loss = w·(f(out) − (x0 − ε))²;
    this loop's predict / prediction / target / loss_weights give the same per-element loss."""
    family, c = get_family("lumina"), tiny
    c.options = dataclasses.replace(c.options, flow=LuminaFlowOptions(model_prediction_type=kind,
                                                                      weighting_scheme=weighting))
    scheme = family.noise_scheme(c)
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    sigmas = torch.tensor([0.3, 0.8])
    timesteps = sigmas * 1000
    x = scheme.add_noise(x0, eps, timesteps)
    text = TextConditioning({"hidden_state": torch.randn(2, 6, c.denoiser.config.cap_feat_dim, generator=g),
                             "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])})
    with torch.no_grad():
        out = c.denoiser(hidden_states=x, timestep=1 - sigmas, encoder_hidden_states=text.tensors["hidden_state"],
                         encoder_attention_mask=text.tensors["attention_mask"].bool(), return_dict=False)[0]
        ours = (scheme.prediction(family.predict(c, x, timesteps, text, {}), x, timesteps)
                - scheme.target(x0, eps, timesteps)) ** 2 * scheme.loss_weights(timesteps).view(-1, 1, 1, 1)
    s = sigmas.view(-1, 1, 1, 1)
    f = {"raw": out, "additive": out + x, "sigma_scaled": x - s * out}[kind]
    w = {"uniform": torch.ones(2), "sigma_sqrt": sigmas ** -2.0,
         "cosmap": 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))}[weighting if kind == "sigma_scaled" else "uniform"]
    theirs = (f - (x0 - eps)) ** 2 * w.view(-1, 1, 1, 1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours.abs().sum() > 0


def test_convert_to_diffusers_loads_in_lumina2_pipeline(tmp_path, tiny):
    """tools/convert_lora.py --to diffusers on a Lumina LoRA (embedders and split_qkv blocks included): diffusers'
    Lumina2Pipeline.load_lora_weights uses every transformer key, and its transformer gives our networks.lora's
    outputs on the same kohya file; --to kohya gives the same modules and ΔW back."""
    import copy

    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

    from library.families.lora_convert import convert
    from networks.lora import create_network_from_weights

    family, c = get_family("lumina"), copy.deepcopy(tiny)
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c),
                         embedder_dims="[4,4,4]", split_qkv="True")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lora in net.unet_loras + net.text_encoder_loras:
            up = torch.randn(lora.lora_up.weight.shape, generator=g) * 0.1
            if getattr(lora, "split", False):  # a trained split module's up: zero off its blocks
                mask, rank, row = torch.zeros_like(up), lora.lora_dim // 3, 0
                for i, rows in enumerate(lora.out_sizes):
                    mask[row:row + rows, i * rank:(i + 1) * rank] = 1
                    row += rows
                up *= mask
            lora.lora_up.weight.copy_(up)
    kohya = {k: v.detach().clone() for k, v in net.state_dict().items()}
    modules = {k.split(".")[0] for k in kohya}
    peft = convert(kohya, "diffusers", "lora.safetensors")
    # per block: q, k, v, out, w1..w3 (+ adaLN where modulated); 4 embedders, 2 final-layer Linears; Gemma-2
    dit = {k.rsplit(".", 2)[0] for k in peft if k.startswith("transformer.")}
    assert len(dit) == 3 * 8 + 2 * 8 + 2 * 7 + 4 + 2
    assert peft["transformer.layers.0.attn.to_k.lora_A.weight"].shape == (4, 48)  # split: rank 4 each, q 48, k/v 24
    assert peft["transformer.layers.0.attn.to_v.lora_B.weight"].shape == (24, 4)
    back = convert(peft, "kohya", "peft")
    assert {k.split(".")[0] for k in back} == modules
    for n in modules:
        delta = [f[n + ".lora_up.weight"].flatten(1) @ f[n + ".lora_down.weight"].flatten(1)
                 * (f[n + ".alpha"] / f[n + ".lora_down.weight"].shape[0]) for f in (kohya, back)]
        torch.testing.assert_close(delta[1], delta[0], rtol=1e-5, atol=1e-6)

    pipe = Lumina2Pipeline(transformer=copy.deepcopy(tiny.denoiser), scheduler=FlowMatchEulerDiscreteScheduler(),
                           vae=tiny.vae, text_encoder=tiny.text_encoders[0], tokenizer=tiny.tokenizers[0])
    pipe.load_lora_weights({k: v for k, v in peft.items() if k.startswith("transformer.")})
    assert {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")} == {p[len("transformer."):]
                                                                                       for p in dit}
    ours, _ = create_network_from_weights(1.0, None, None, c.text_encoders, c.denoiser, weights_sd=kohya,
                                          lora_targets=family.lora_targets(c))
    ours.apply_to(c.text_encoders, c.denoiser, apply_text_encoder=False)
    ours.load_weights(kohya)
    x = torch.randn(2, 16, 8, 8, generator=g)
    caption = torch.randn(2, 6, c.denoiser.config.cap_feat_dim, generator=g)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2]).bool()
    with torch.no_grad():
        mine = c.denoiser(hidden_states=x, timestep=torch.tensor([0.3, 0.8]), encoder_hidden_states=caption,
                          encoder_attention_mask=mask, return_dict=False)[0]
        theirs = pipe.transformer(hidden_states=x, timestep=torch.tensor([0.3, 0.8]), encoder_hidden_states=caption,
                                  encoder_attention_mask=mask, return_dict=False)[0]
        plain = tiny.denoiser(hidden_states=x, timestep=torch.tensor([0.3, 0.8]), encoder_hidden_states=caption,
                              encoder_attention_mask=mask, return_dict=False)[0]
    ours.restore()
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert (mine - plain).abs().max() > 1e-3  # the LoRA changes the output
