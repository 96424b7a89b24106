"""--network_module networks.oft_flux on tiny FLUX.1: sd-scripts' file layout, reload, hook and merge."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.families import get_family
from tests.train_helpers import base_args, make_dataset, make_trainer

# Read from sd-scripts 48d368fa networks/oft_flux.py: "oft_unet" + BFL module path; attention only (class
# SelfAttention: double blocks' img_attn / txt_attn qkv and proj) unless enable_all_linear (every Linear of
# DoubleStreamBlock / SingleStreamBlock); qkv and linear1 keep one oft_blocks.<i> per part (split_dims), every
# other layer one oft_blocks.0; [dim, rows/dim, rows/dim] each, plus a 0-dim alpha. Tiny FLUX.1: 2 double and
# 3 single blocks, hidden 32, MLP 128, modulation 192 (double) / 96 (single).
DOUBLE_ATTN = {"img_attn_qkv": [32] * 3, "img_attn_proj": [32], "txt_attn_qkv": [32] * 3, "txt_attn_proj": [32]}
DOUBLE_ALL = {**DOUBLE_ATTN, "img_mod_lin": [192], "txt_mod_lin": [192], "img_mlp_0": [128], "img_mlp_2": [32],
              "txt_mlp_0": [128], "txt_mlp_2": [32]}
SINGLE_ALL = {"linear1": [32, 32, 32, 128], "linear2": [32], "modulation_lin": [96]}


def expected(all_linear: bool) -> dict[str, list[int]]:
    layers = {f"double_blocks_{b}_{n}": rows for b in range(2) for n, rows in
              (DOUBLE_ALL if all_linear else DOUBLE_ATTN).items()}
    if all_linear:
        layers.update({f"single_blocks_{b}_{n}": rows for b in range(3) for n, rows in SINGLE_ALL.items()})
    out = {}
    for name, rows in layers.items():
        out[f"oft_unet_{name}.alpha"] = []
        out.update({f"oft_unet_{name}.oft_blocks.{i}": [4, r // 4, r // 4] for i, r in enumerate(rows)})
    return out


def flux_output(components):
    family = get_family("flux")
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 8, 8, generator=g)
    with torch.no_grad():
        text = family.encode_text(components, family.tokenize(components, ["sks toy"], None), None)
        return family.predict(components, latents, torch.tensor([500]), text, {})


def train(tmp_path, *network_args):
    data = make_dataset(str(tmp_path), n=1)
    extra = ["--network_module", "networks.oft_flux", "--network_alpha", "1e-3", "--learning_rate", "1e-2",
             "--t5xxl_max_token_length", "16", "--network_train_unet_only"]
    if network_args:
        extra += ["--network_args", *network_args]
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:flux", steps=2, extra=extra), "flux")
    path = trainer.run()
    network = trainer.accelerator.unwrap_model(trainer.network).eval()
    return path, flux_output(trainer.components), trainer, network


@pytest.mark.parametrize("all_linear", [False, True])
def test_oft_flux_file_has_sd_scripts_names_and_shapes(tmp_path, all_linear):
    path = train(tmp_path, *(["enable_all_linear=True"] if all_linear else []))[0]
    with safe_open(path, framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        md = f.metadata()
        moved = sum(bool(f.get_tensor(k).abs().max() > 0) for k in f.keys() if ".oft_blocks." in k)
    assert shapes == expected(all_linear)
    assert moved == sum(".oft_blocks." in k for k in shapes)
    assert md["ss_network_module"] == "networks.oft_flux"


def test_oft_flux_reloads_strictly_hooks_and_merges_to_the_trained_output(tmp_path):
    from networks import oft_flux

    path, want, trainer, trained = train(tmp_path)
    trained.restore()  # the trainer's own model (its --t5xxl_max_token_length) without the trained network
    family = get_family("flux")
    c = trainer.components
    base = flux_output(c)
    network, _ = oft_flux.create_network_from_weights(1.0, path, None, c.text_encoders, c.denoiser,
                                                      lora_targets=family.lora_targets(c))
    network.apply_to(c.text_encoders, c.denoiser)
    info = network.load_state_dict(load_file(path), strict=True)
    assert (info.missing_keys, info.unexpected_keys) == ([], [])
    got = flux_output(c)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, base)
    network.restore()
    torch.testing.assert_close(flux_output(c), base, rtol=0, atol=0)
    network.merge_to(c.text_encoders, c.denoiser, load_file(path))
    torch.testing.assert_close(flux_output(c), want, rtol=1e-4, atol=1e-5)


def test_merge_lora_merges_an_oft_flux_file_into_the_fused_layers(tmp_path):
    """merge_lora's path (load_adapter_file, in_family_names, merge_into_layers): each part of a fused BFL layer is
    turned by its own rotation, the rows of its diffusers Linear; the result equals the hooked network."""
    from networks import oft_flux
    from networks.lora_merge import WeightedLora, merge_into_layers
    from tools.lora_models import in_family_names, load_adapter_file, load_model, lora_layers

    path = train(tmp_path, "enable_all_linear=True")[0]
    family = get_family("flux")
    hooked, merged = load_model("tiny:flux", "flux"), load_model("tiny:flux", "flux")
    base = flux_output(hooked.components)
    c = hooked.components
    network, _ = oft_flux.create_network_from_weights(1.0, path, None, c.text_encoders, c.denoiser,
                                                      lora_targets=family.lora_targets(c))
    network.apply_to(c.text_encoders, c.denoiser)
    network.load_state_dict(load_file(path), strict=True)
    want = flux_output(c)
    lora = load_adapter_file(path)
    assert merge_into_layers(lora_layers(merged), [WeightedLora(in_family_names(merged, lora.modules), 1.0)]) == 29
    got = flux_output(merged.components)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, base)
