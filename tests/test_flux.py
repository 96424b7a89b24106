"""FLUX.1 family: packing, LoRA names and counts, the fused qkv LoRA, diffusers' converter, a tiny run."""

import dataclasses
import logging
import os

import pytest
import torch

from library.cli.options import options_from_values
from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import LoadOptions
from library.families.flux.family import image_ids, pack_latents, unpack_latents
from library.families.flux.configs import build_flux_modules
from library.families.flux.options import FluxOptions
from networks.lora import create_network
from networks.lora_fused import FusedLoRAModule
from tests.train_helpers import assert_close_measured, base_args, make_dataset, make_trainer

DOUBLE_0 = ["img_mod_lin", "txt_mod_lin", "img_attn_qkv", "img_attn_proj", "txt_attn_qkv", "txt_attn_proj",
            "img_mlp_0", "img_mlp_2", "txt_mlp_0", "txt_mlp_2"]
SINGLE_0 = ["modulation_lin", "linear1", "linear2"]


@pytest.fixture
def tiny(tiny_flux):
    return get_family("flux"), tiny_flux


def _network(family, components, dim=4, alpha=2.0):
    return create_network(1.0, dim, alpha, components.vae, components.text_encoders, components.denoiser,
                          lora_targets=family.lora_targets(components))


def test_pack_unpack_and_ids():
    x = torch.arange(2 * 16 * 4 * 6, dtype=torch.float32).reshape(2, 16, 4, 6)
    packed = pack_latents(x)
    assert packed.shape == (2, 6, 64)
    # first patch: channel 0's 2x2 corner (0, 1, 6, 7), then channel 1's (24, 25, 30, 31)
    assert packed[0, 0, :8].tolist() == [0, 1, 6, 7, 24, 25, 30, 31]
    assert torch.equal(unpack_latents(packed, 4, 6), x)
    assert image_ids(4, 6).tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 1, 2]]


def test_tiny_lora_names_are_bfl_in_block_order_with_fused_shapes(tiny):
    """The counts are tests/test_family_contract.py's; here the BFL names, their order and the fused shapes."""
    family, components = tiny
    net = _network(family, components)
    names = [lora.lora_name for lora in net.unet_loras]
    assert names[:10] == [f"lora_unet_double_blocks_0_{n}" for n in DOUBLE_0]
    assert names[20:23] == [f"lora_unet_single_blocks_0_{n}" for n in SINGLE_0]
    assert net.text_encoder_loras[0].lora_name == "lora_te1_text_model_encoder_layers_0_self_attn_k_proj"
    sd = net.state_dict()
    # tiny inner dim 32, MLP 128: qkv 3·32, linear1 3·32 + 128, with ONE down of the requested rank
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape == (96, 4)
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape == (4, 32)
    assert sd["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (224, 4)
    assert float(sd["lora_unet_single_blocks_0_linear1.alpha"]) == 2.0


def test_full_size_counts_on_meta():
    family = get_family("flux")
    parts = build_flux_modules("random:flux-dev", device="meta")
    from library.families.base import Components

    c = Components(parts["transformer"], parts["vae"], [parts["text_encoder"], parts["text_encoder_2"]],
                   [parts["tokenizer"], parts["tokenizer_2"]])
    targets = family.lora_targets(c) + [family.t5_lora_target(c)]
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=targets)
    assert len(net.unet_loras) == 304
    te = [lora.lora_name for lora in net.text_encoder_loras]
    assert sum(n.startswith("lora_te1_") for n in te) == 72 and sum(n.startswith("lora_te3_") for n in te) == 168
    assert "lora_te3_encoder_block_0_layer_1_DenseReluDense_wi_0" in te
    ups = {lora.lora_name: lora.lora_up.weight.shape[0] for lora in net.unet_loras}
    assert ups["lora_unet_double_blocks_0_img_attn_qkv"] == 9216
    assert ups["lora_unet_double_blocks_0_img_mod_lin"] == 18432
    assert ups["lora_unet_single_blocks_37_linear1"] == 21504


def test_fused_lora_equals_split_delta_and_merge(tiny_flux_copy):
    family, components = get_family("flux"), tiny_flux_copy  # merged into below
    net = _network(family, components)
    net.apply_to(components.text_encoders, components.denoiser, False, True)
    lora = dict((m.lora_name, m) for m in net.unet_loras)["lora_unet_single_blocks_0_linear1"]
    assert isinstance(lora, FusedLoRAModule)
    torch.manual_seed(0)
    torch.nn.init.normal_(lora.lora_up.weight)
    q, k, v, mlp = lora.org_modules
    x = torch.randn(3, 32)
    with torch.no_grad():
        outs = [m(x) for m in (q, k, v, mlp)]  # patched forwards: base + LoRA slice
        net.restore()
        base = [m(x) for m in (q, k, v, mlp)]
    deltas = lora.delta_weights()
    assert [d.shape[0] for d in deltas] == [32, 32, 32, 128]
    for out, b, d in zip(outs, base, deltas):
        torch.testing.assert_close(out - b, x @ d.T, rtol=1e-5, atol=1e-5)
    fused = lora.lora_up.weight @ lora.lora_down.weight * 0.5  # alpha 2 / rank 4
    torch.testing.assert_close(torch.cat(deltas), fused)
    before = q.weight.detach().clone()
    net.merge_to(None, components.denoiser, dtype=torch.float32)
    torch.testing.assert_close(q.weight - before, deltas[0])
    q.weight.data.copy_(before)


def test_diffusers_kohya_flux_converter_reads_every_key(caplog):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_kohya_flux_lora_to_diffusers,
    )

    family = get_family("flux")
    from library.families.base import Components

    with torch.device("meta"):
        from diffusers import FluxTransformer2DModel

        from library.families.flux.configs import PRESETS, transformer_config

        transformer = FluxTransformer2DModel(**transformer_config(PRESETS["random:flux-dev"]))
    c = Components(transformer, None, [None], [None])
    net = create_network(1.0, 2, 4.0, None, None, None, lora_targets=family.lora_targets(c)[:1])
    net.to_empty(device="cpu")  # materialise only the LoRA tensors
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in net.unet_loras:
            lora.lora_down.weight.copy_(torch.randn(lora.lora_down.weight.shape, generator=gen))
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=gen))
            lora.alpha.fill_(4.0)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        converted = _convert_kohya_flux_lora_to_diffusers(dict(state))
    assert "Unsupported keys" not in caplog.text
    assert len(converted) == 2 * (19 * 14 + 38 * 6)  # every split projection gets lora_A and lora_B
    for lora in net.unet_loras:
        # ΔW_i @ probe = up_i @ (down @ probe) · alpha / rank, without building the full-size ΔW
        ups = torch.split(lora.lora_up.weight, getattr(lora, "out_sizes", [lora.lora_up.weight.shape[0]]))
        paths = [n for n, m in transformer.named_modules() if any(m is o for o in getattr(lora, "org_modules",
                                                                                            (lora.org_module,)))]
        order = {id(m): i for i, m in enumerate(getattr(lora, "org_modules", (lora.org_module,)))}
        paths.sort(key=lambda p: order[id(transformer.get_submodule(p))])
        assert len(paths) == len(ups)
        for path, up in zip(paths, ups):
            a, b = converted[f"transformer.{path}.lora_A.weight"], converted[f"transformer.{path}.lora_B.weight"]
            probe = torch.randn(a.shape[1], 2, generator=gen)
            expected = up.detach() @ (lora.lora_down.weight.detach() @ probe) * 2.0  # alpha 4 / rank 2
            torch.testing.assert_close(b @ (a @ probe), expected, rtol=1e-4, atol=1e-3)


def test_flag_errors_are_one_line():
    family = get_family("flux")
    with pytest.raises(ConfigError, match="^--t5xxl_max_token_length: expected an integer from 1 to 512"):
        options_from_values(FluxOptions, {"t5xxl_max_token_length": 1024})
    from library.families.base import ModelLoadError

    with pytest.raises(ModelLoadError, match="unknown FLUX.1 preset 'tiny:sd1'"):
        family.load(LoadOptions("tiny:sd1"))


def test_tiny_flux_lora_training_run(tmp_path):
    from safetensors import safe_open

    data = make_dataset(str(tmp_path), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:flux", steps=3, extra=[
        "--t5xxl_max_token_length", "16", "--apply_t5_attn_mask", "--cache_text_encoder_outputs",
        "--network_train_unet_only", "--loss_type", "huber", "--timestep_sampling", "shift",
        "--model_prediction_type", "sigma_scaled", "--weighting_scheme", "cosmap", "--guidance_scale", "1.0"]), "flux")
    path = trainer.run()
    with safe_open(path, "pt") as f:
        keys = sorted(f.keys())
        metadata = f.metadata()
        up = f.get_tensor("lora_unet_double_blocks_1_txt_attn_qkv.lora_up.weight")
    assert len(keys) == 29 * 3
    assert keys[:3] == ["lora_unet_double_blocks_0_img_attn_proj.alpha",
                        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight",
                        "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight"]
    assert up.shape == (96, 4) and up.abs().sum() > 0  # trained
    assert metadata["ss_base_model_version"] == "flux1"
    assert (metadata["ss_timestep_sampling"], metadata["ss_model_prediction_type"], metadata["ss_weighting_scheme"],
            metadata["ss_guidance_scale"], metadata["ss_discrete_flow_shift"], metadata["ss_apply_t5_attn_mask"]) \
        == ("shift", "sigma_scaled", "cosmap", "1.0", "3.0", "True")
    assert metadata["modelspec.architecture"] == "flux-1-dev/lora"
    assert metadata["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"


def test_save_checkpoint_writes_a_folder_the_loader_reads(tmp_path, tiny_flux_copy):
    family = get_family("flux")
    comps = tiny_flux_copy  # changed below
    with torch.no_grad():
        next(comps.denoiser.parameters()).add_(1.0)  # as a merge would change it
    family.save_checkpoint(comps, str(tmp_path / "merged"))
    back = family.load(LoadOptions(str(tmp_path / "merged")))
    a, b = comps.denoiser.state_dict(), back.denoiser.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_text_cache_key_includes_the_flags_that_change_t5_outputs():
    from library.data.te_cache import cache_source_id

    family = get_family("flux")
    base = FluxOptions(t5xxl_max_token_length=16, apply_t5_attn_mask=False, guidance_scale=3.5)

    def key_of(options):
        return cache_source_id("tiny:flux", torch.float32, family.text_cache_values(options))

    key = key_of(base)
    assert key == "tiny:flux|torch.float32|clip_l=None|t5xxl=None|t5xxl_max_token_length=16|apply_t5_attn_mask=False"
    assert key_of(dataclasses.replace(base, t5xxl="t5.sft")) != key
    assert key_of(dataclasses.replace(base, apply_t5_attn_mask=True)) != key
    assert key_of(dataclasses.replace(base, guidance_scale=1.0)) == key  # not a text-encoder setting


def test_disk_latent_cache_uses_sd_scripts_flux_keys_one_file_for_all_resolutions(tmp_path, monkeypatch):
    import glob

    import numpy as np

    data = make_dataset(str(tmp_path), n=1, sizes=((128, 128),))
    args = base_args(data, str(tmp_path / "out"), "tiny:flux", steps=1, extra=[
        "--t5xxl_max_token_length", "8", "--network_train_unet_only", "--resolution", "64;128",
        "--cache_latents", "--cache_latents_to_disk"])
    make_trainer(args, "flux").run()
    files = glob.glob(os.path.join(data, "*", "*.npz"))
    assert [os.path.basename(p) for p in files] == ["img0_0128x0128_flux.npz"]
    with np.load(files[0]) as npz:
        assert sorted(k for k in npz.files if k.startswith("latents")) == ["latents_16x16", "latents_8x8"]
        assert npz["latents_16x16"].shape == (16, 16, 16) and npz["latents_8x8"].shape == (16, 8, 8)
        assert list(npz["original_size_8x8"]) == [128, 128]
    trainer = make_trainer(args, "flux")
    encoded = []
    original = trainer.family.encode_images
    monkeypatch.setattr(trainer.family, "encode_images", lambda vae, x, *more: encoded.append(len(x)) or original(vae, x, *more))
    trainer.run()
    assert encoded == []  # both resolutions were found in the one file


def test_clip_l_trains_while_t5_outputs_are_cached_and_equals_an_uncached_run(tmp_path):
    """As sd-scripts allows for FLUX.1: CLIP-L's LoRA trains live, T5's outputs come from the cache."""
    from safetensors.torch import load_file

    data = make_dataset(str(tmp_path), n=2)
    flags = ["--t5xxl_max_token_length", "8", "--text_encoder_lr", "1e-3"]
    plain = make_trainer(base_args(data, str(tmp_path / "a"), "tiny:flux", steps=3, extra=flags), "flux")
    cached = make_trainer(base_args(data, str(tmp_path / "b"), "tiny:flux", steps=3,
                                    extra=flags + ["--cache_text_encoder_outputs"]), "flux")
    a, b = load_file(plain.run()), load_file(cached.run())
    assert cached.trained_encoders == frozenset({0}) and cached.ctx.live_encoders == frozenset({0})
    assert {k for entry in cached.ctx.text_cache.values() for k in entry} == {"t5_out", "txt_ids", "t5_attn_mask"}
    assert a.keys() == b.keys() and any(k.startswith("lora_te1_") for k in b)
    assert b["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight"].abs().sum() > 0  # CLIP trained
    # the cache encodes the captions in other batches than training: measured 0 with the AVX-512, AVX2 and default
    # kernels (ATEN_CPU_CAPABILITY); 3e-5 leaves room for kernels that depend on the batch. A cache of
    # float16-rounded T5 states gives 1.2e-4
    assert_close_measured(b, a, 3e-5, "T5 cached vs live: LoRA")


def test_caching_text_outputs_while_every_encoder_trains_stops_with_one_line(tmp_path, capsys):
    from library.cli.entry import run_training

    data = make_dataset(str(tmp_path), n=1)
    argv = base_args(data, str(tmp_path / "out"), "tiny:flux", steps=1, extra=[
        "--t5xxl_max_token_length", "8", "--cache_text_encoder_outputs", "--network_args", "train_t5xxl=True"])
    assert run_training("flux", "test", argv) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --cache_text_encoder_outputs: every text encoder trains, so there is nothing to cache; drop the flag, "
        "or train fewer encoders (e.g. --network_train_unet_only)")


def test_full_text_cache_files_serve_a_run_that_trains_clip_l(tmp_path, monkeypatch):
    """Files holding both encoders' outputs (a unet-only run or the cache tool) are reused for T5's part."""
    import glob

    import numpy as np

    data = make_dataset(str(tmp_path), n=2)
    flags = ["--t5xxl_max_token_length", "8", "--cache_text_encoder_outputs_to_disk"]
    make_trainer(base_args(data, str(tmp_path / "a"), "tiny:flux", steps=1,
                           extra=flags + ["--network_train_unet_only"]), "flux").run()
    files = sorted(glob.glob(os.path.join(data, "*", "*_flux_te.npz")))
    assert len(files) == 2
    trainer = make_trainer(base_args(data, str(tmp_path / "b"), "tiny:flux", steps=1, extra=flags), "flux")
    encoded = []
    original = trainer.family.encode_text_with
    monkeypatch.setattr(trainer.family, "encode_text_with",
                        lambda c, t, s, enc: encoded.append((len(t[0]), tuple(sorted(enc)))) or original(c, t, s, enc))
    trainer.run()
    # the shape probe ("") and the training step run CLIP-L; T5 ran only for the probe
    assert [e for e in encoded if 1 in e[1]] == [(1, (1,))]
    with np.load(files[0]) as npz:
        assert {"l_pooled", "t5_out", "txt_ids", "t5_attn_mask"} <= set(npz.files)  # left whole
