"""Issue 11 item 6: LyCORIS `preset=full` SDXL files name modules outside the UNet's blocks (conv_in,
label_emb, time_embed, out.2). Every tool handles every module a kohya-format file can name, or names the
ones it cannot and stops with one line."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.core.errors import ConfigError
from library.families import get_family
from library.train.adapters.network_apply import NetworkSpec, apply_networks
from tools.lora_models import LoadedModel, load_model, lora_layers

# The six modules outside the blocks, as a full-preset SDXL file names them (kohya/SGM names; conv_in as
# LyCORIS spells it on a diffusers UNet), and the diffusers layer each one is.
OUTSIDE = {
    "lora_unet_conv_in": "conv_in",
    "lora_unet_time_embed_0": "time_embedding.linear_1",
    "lora_unet_time_embed_2": "time_embedding.linear_2",
    "lora_unet_label_emb_0_0": "add_embedding.linear_1",
    "lora_unet_label_emb_0_2": "add_embedding.linear_2",
    "lora_unet_out_2": "conv_out",
}
# A few ordinary modules as well (attention, resnet conv, text encoder).
ORDINARY = ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", "lora_unet_output_blocks_2_0_in_layers_2",
            "lora_te1_text_model_encoder_layers_0_mlp_fc1")
RANK = 2


def _module_pair(weight: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if weight.dim() == 4:
        return (torch.randn(RANK, *weight.shape[1:], generator=gen) * 0.1,
                torch.randn(weight.shape[0], RANK, 1, 1, generator=gen) * 0.1)
    return torch.randn(RANK, weight.shape[1], generator=gen) * 0.1, torch.randn(weight.shape[0], RANK, generator=gen) * 0.1


def _delta(down: torch.Tensor, up: torch.Tensor, shape) -> torch.Tensor:
    """ΔW at alpha = rank (scale 1), in the layer's shape (k×k down, 1×1 up)."""
    return (up.flatten(1) @ down.flatten(1)).reshape(shape)


@pytest.fixture
def full_file(tmp_path, tiny_sdxl):
    """A kohya-format LyCORIS full-preset-like LoRA for tiny:sdxl: random factors in each layer's shape."""
    unet = tiny_sdxl.denoiser
    layers = lora_layers(LoadedModel(get_family("sdxl"), tiny_sdxl), include_conv=True)
    weights = {name: unet.get_submodule(path).weight for name, path in OUTSIDE.items()}
    weights.update({name: layers[name].weight for name in ORDINARY})
    gen = torch.Generator().manual_seed(0)
    state, deltas = {}, {}
    for name, weight in weights.items():
        down, up = _module_pair(weight.detach(), gen)
        state.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                      f"{name}.alpha": torch.tensor(float(RANK))})
        deltas[name] = _delta(down, up, weight.shape)
    path = str(tmp_path / "full.safetensors")
    save_file(state, path, {"ss_network_module": "lycoris.kohya", "ss_base_model_version": "sdxl_base_v1-0",
                            "ss_network_args": '{"preset": "full", "algo": "lora"}'})
    return path, deltas


def _run(tool, argv):
    import importlib

    return importlib.import_module(f"tools.{tool}").main(argv)


def test_issue6_resize_with_a_recipe_and_base_model(full_file, tiny_sdxl_file, tmp_path, capsys):
    """Issue 11 item 6: resize_lora with a recipe needing the base model failed on lora_unet_conv_in."""
    path, deltas = full_file
    out = str(tmp_path / "r.safetensors")
    assert _run("resize_lora", ["--model", path, "--save_to", out, "--new_rank", str(RANK), "--dynamic_method",
                                "recipe", "--dynamic_param", "fro_ckpt=1,thr=-10", "--base_model", tiny_sdxl_file,
                                "--model_family", "sdxl"]) == 0, capsys.readouterr().err
    resized = load_file(out)
    assert {k.partition(".")[0] for k in resized} == set(deltas)
    for name in OUTSIDE:  # nothing cut at full rank: ΔW kept
        down, up = resized[f"{name}.lora_down.weight"], resized[f"{name}.lora_up.weight"]
        scale = float(resized[f"{name}.alpha"]) / down.shape[0]
        torch.testing.assert_close(_delta(down, up, deltas[name].shape) * scale, deltas[name], rtol=1e-4, atol=1e-5)


def test_issue6_merge_into_the_model(full_file, tiny_sdxl_file, tmp_path, capsys):
    """Issue 11 item 6: merge_lora --sd_model said "module lora_unet_conv_in matches no layer"."""
    path, deltas = full_file
    out = str(tmp_path / "merged.safetensors")
    assert _run("merge_lora", ["--sd_model", tiny_sdxl_file, "--model_family", "sdxl", "--models", path,
                               "--save_to", out]) == 0, capsys.readouterr().err
    base, merged = load_model(tiny_sdxl_file, "sdxl").components, load_model(out, "sdxl").components
    for name, layer in OUTSIDE.items():
        diff = merged.denoiser.get_submodule(layer).weight - base.denoiser.get_submodule(layer).weight
        torch.testing.assert_close(diff, deltas[name], rtol=1e-4, atol=1e-5)


def test_issue6_generation_with_networks_lora_merges_every_module(full_file, tiny_sdxl_copy):
    """Issue 11 item 6: generate.py with networks.lora dropped the six modules (a warning only)."""
    path, deltas = full_file
    family = get_family("sdxl")
    before = {layer: tiny_sdxl_copy.denoiser.get_submodule(layer).weight.detach().clone() for layer in OUTSIDE.values()}
    apply_networks(family, tiny_sdxl_copy, [NetworkSpec("networks.lora", path, 1.0)], merge=True,
                   device=torch.device("cpu"), dtype=torch.float32)
    for name, layer in OUTSIDE.items():
        diff = tiny_sdxl_copy.denoiser.get_submodule(layer).weight.detach() - before[layer]
        torch.testing.assert_close(diff, deltas[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("module", ["networks.lora", "lycoris.kohya"])
def test_issue6_generation_hooks_every_module(full_file, tiny_sdxl_copy, module):
    """Issue 11 item 6: with lycoris.kohya generation crashed ("duplicated lora name"); every module of the
    file is now hooked in."""
    pytest.importorskip("lycoris")
    path, deltas = full_file
    applied = apply_networks(get_family("sdxl"), tiny_sdxl_copy, [NetworkSpec(module, path, 1.0)], merge=False,
                             device=torch.device("cpu"), dtype=torch.float32)
    try:
        [network] = applied.networks
        assert len(network.text_encoder_loras + network.unet_loras) == len(deltas)
        unet = tiny_sdxl_copy.denoiser
        x = torch.randn(1, unet.conv_in.in_channels, 8, 8)
        plain = torch.nn.functional.conv2d(x, unet.conv_in.weight, unet.conv_in.bias, padding=1)
        hooked = unet.conv_in(x)
        expected = plain + torch.nn.functional.conv2d(x, deltas["lora_unet_conv_in"], padding=1)
        torch.testing.assert_close(hooked, expected, rtol=1e-4, atol=1e-4)
    finally:
        applied.remove()


def test_issue6_a_module_no_layer_has_stops_generation_with_one_line(full_file, tiny_sdxl_copy, tmp_path):
    """Issue 11 item 6: modules that fit nothing are named, not dropped silently."""
    path, _ = full_file
    state = load_file(path)
    state.update({"lora_unet_no_such_layer.lora_down.weight": torch.zeros(RANK, 4),
                  "lora_unet_no_such_layer.lora_up.weight": torch.zeros(4, RANK),
                  "lora_unet_no_such_layer.alpha": torch.tensor(1.0)})
    bad = str(tmp_path / "bad.safetensors")
    save_file(state, bad)
    with pytest.raises(ConfigError, match=r"1 of its 10 modules match no layer .*: lora_unet_no_such_layer$"):
        apply_networks(get_family("sdxl"), copy.copy(tiny_sdxl_copy), [NetworkSpec("networks.lora", bad, 1.0)],
                       merge=True, device=torch.device("cpu"), dtype=torch.float32)


def test_issue6_networks_lora_never_trains_the_outside_layers(tiny_sdxl):
    """The optional targets come only from a file: training with networks.lora keeps sd-scripts' modules."""
    from library.train.adapters.network_kinds import network_kind
    from library.train.settings import NetworkOptions

    family = get_family("sdxl")
    network = network_kind("networks.lora").create(family, tiny_sdxl, NetworkOptions(network_dim=2, network_alpha=1,
                                                                                      network_args={"conv_dim": "2"}))
    names = {lora.lora_name for lora in network.unet_loras}
    assert not names & set(OUTSIDE) and "lora_unet_input_blocks_0_0" not in names
    assert "lora_unet_output_blocks_2_0_in_layers_2" in names


def test_issue6_sd1_outside_layers_merge_at_generation(tiny_sd1_copy, tmp_path):
    """Issue 11 item 6, SD 1.x: the same layers under their diffusers names (conv_in, time_embedding_linear_1,
    conv_out) are applied, not dropped."""
    unet = tiny_sd1_copy.denoiser
    gen = torch.Generator().manual_seed(1)
    state, deltas = {}, {}
    for name, layer in (("lora_unet_conv_in", "conv_in"), ("lora_unet_time_embedding_linear_1", "time_embedding.linear_1"),
                        ("lora_unet_conv_out", "conv_out")):
        weight = unet.get_submodule(layer).weight.detach()
        down, up = _module_pair(weight, gen)
        state.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                      f"{name}.alpha": torch.tensor(float(RANK))})
        deltas[layer] = (_delta(down, up, weight.shape), weight.clone())
    path = str(tmp_path / "sd1_full.safetensors")
    save_file(state, path)
    apply_networks(get_family("sd"), tiny_sd1_copy, [NetworkSpec("networks.lora", path, 1.0)], merge=True,
                   device=torch.device("cpu"), dtype=torch.float32)
    for layer, (delta, before) in deltas.items():
        torch.testing.assert_close(unet.get_submodule(layer).weight.detach() - before, delta, rtol=1e-4, atol=1e-5)
