"""FLUX.1 in the BFL single-file layout: the transformer converter, --clip_l / --t5xxl / --ae files, saving, errors."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.families import get_family
from library.families.base import LoadOptions, ModelLoadError
from library.families.flux.layout import (
    bfl_to_diffusers,
    diffusers_key_to_bfl,
    diffusers_to_bfl,
    infer_transformer_config,
)
from library.families.flux.configs import (
    PRESETS,
    transformer_config,
)
from library.families.flux.options import FluxOptions
from tests.train_helpers import base_args, make_dataset, make_trainer

DOUBLE_BLOCK_KEYS = sorted(
    [f"{side}_{name}.{p}" for side in ("img", "txt") for name in ("attn.proj", "attn.qkv", "mlp.0", "mlp.2", "mod.lin")
     for p in ("weight", "bias")]
    + [f"{side}_attn.norm.{n}_norm.scale" for side in ("img", "txt") for n in ("query", "key")])
SINGLE_BLOCK_KEYS = ["linear1.bias", "linear1.weight", "linear2.bias", "linear2.weight", "modulation.lin.bias",
                     "modulation.lin.weight", "norm.key_norm.scale", "norm.query_norm.scale"]
TRAIN_FLAGS = ["--t5xxl_max_token_length", "16", "--cache_text_encoder_outputs", "--network_train_unet_only",
               "--guidance_scale", "1.0"]


@pytest.fixture
def preset(tiny_flux_modules):
    """tiny:flux as build_flux_modules returns it."""
    return tiny_flux_modules


@pytest.fixture
def files(tiny_flux_files):
    """The tiny model written by tools/make_tiny_model.py in the BFL layout: {"transformer", "clip_l", "t5xxl", "ae"}."""
    return tiny_flux_files


def _flags(files) -> list[str]:
    return [a for flag in ("clip_l", "t5xxl", "ae") for a in (f"--{flag}", files[flag])]


def _load(path, **flags):
    family = get_family("flux")
    return family.load(LoadOptions(path, family_options=FluxOptions(**flags)))


def _meta_transformer(preset_name):
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel(**transformer_config(PRESETS[preset_name]))


# --- the converter -------------------------------------------------------------------------

def test_converter_round_trip_is_exact(preset):
    sd = preset["transformer"].state_dict()
    bfl = diffusers_to_bfl(sd)
    assert len(bfl) == 2 * len(DOUBLE_BLOCK_KEYS) + 3 * len(SINGLE_BLOCK_KEYS) + 20
    assert sorted(k[len("double_blocks.0."):] for k in bfl if k.startswith("double_blocks.0.")) == DOUBLE_BLOCK_KEYS
    assert sorted(k[len("single_blocks.2."):] for k in bfl if k.startswith("single_blocks.2.")) == SINGLE_BLOCK_KEYS
    assert bfl["double_blocks.0.img_attn.qkv.weight"].shape == (96, 32)
    assert bfl["single_blocks.0.linear1.weight"].shape == (224, 32)
    # q, k, v then the MLP input, stacked by rows; final adaLN halves swapped back to (shift, scale)
    assert torch.equal(bfl["single_blocks.1.linear1.weight"][32:64], sd["single_transformer_blocks.1.attn.to_k.weight"])
    assert torch.equal(bfl["single_blocks.1.linear1.bias"][96:], sd["single_transformer_blocks.1.proj_mlp.bias"])
    assert torch.equal(bfl["final_layer.adaLN_modulation.1.weight"][:32], sd["norm_out.linear.weight"][32:])
    back = bfl_to_diffusers(bfl)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    again = diffusers_to_bfl(back)
    assert again.keys() == bfl.keys() and all(torch.equal(again[k], bfl[k]) for k in bfl)
    assert diffusers_key_to_bfl("transformer_blocks.1.attn.add_v_proj.bias") == ("double_blocks.1.txt_attn.qkv.bias", 2)
    assert diffusers_key_to_bfl("single_transformer_blocks.0.attn.norm_k.weight") == \
        ("single_blocks.0.norm.key_norm.scale", None)
    assert infer_transformer_config(bfl) == transformer_config(PRESETS["tiny:flux"])


@pytest.mark.parametrize("name", ["random:flux-dev", "random:flux-schnell"])
def test_full_size_layout_and_config_on_meta(name):
    bfl = diffusers_to_bfl(_meta_transformer(name).state_dict())
    assert len(bfl) == (780 if name.endswith("dev") else 776)  # flux1-dev.safetensors holds 780 tensors
    assert bfl["double_blocks.18.img_attn.qkv.weight"].shape == (9216, 3072)
    assert bfl["single_blocks.37.linear1.weight"].shape == (21504, 3072)
    assert bfl["final_layer.adaLN_modulation.1.weight"].shape == (6144, 3072)
    assert infer_transformer_config({"model.diffusion_model." + k: v for k, v in bfl.items()}) == \
        transformer_config(PRESETS[name])


@pytest.mark.parametrize("name", ["random:flux-dev", "random:flux-schnell"])
def test_agrees_with_diffusers_converter_on_the_full_layout(name):
    from diffusers.loaders.single_file_utils import (
        convert_flux_transformer_checkpoint_to_diffusers,
    )

    # Full-size row counts (diffusers hard-codes FLUX.1's 3072 width when splitting linear1) but two columns,
    # so the real layout is compared value by value in a few MB.
    gen = torch.Generator().manual_seed(0)
    shapes = {k: v.shape for k, v in diffusers_to_bfl(_meta_transformer(name).state_dict()).items()}
    thin = {k: torch.randn((s[0], 2) if len(s) == 2 else (s[0],), generator=gen) for k, s in shapes.items()}
    prefixed = {"model.diffusion_model." + k: v for k, v in thin.items()}
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(prefixed))
    ours = bfl_to_diffusers(prefixed)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(torch.equal(v, thin[k]) for k, v in diffusers_to_bfl(ours).items())


def test_float8_and_scaled_float8_are_upcast(preset):
    bfl = diffusers_to_bfl(preset["transformer"].state_dict())
    fp8 = {k: (v.to(torch.float8_e4m3fn) if k.endswith("qkv.weight") else v) for k, v in bfl.items()}
    key = "double_blocks.0.img_attn.qkv.weight"
    # ComfyUI's scaled fp8: weight · scale_weight; the markers are dropped
    fp8["double_blocks.1.img_attn.qkv.scale_weight"] = torch.tensor(2.0)
    fp8["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    out = bfl_to_diffusers(fp8)
    assert out.keys() == preset["transformer"].state_dict().keys()
    expected_q = bfl[key].to(torch.float8_e4m3fn).to(torch.bfloat16)[:32]
    assert out["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert torch.equal(out["transformer_blocks.0.attn.to_q.weight"], expected_q)
    scaled = (bfl["double_blocks.1.img_attn.qkv.weight"].to(torch.float8_e4m3fn).float() * 2).to(torch.bfloat16)
    assert torch.equal(out["transformer_blocks.1.attn.to_v.weight"], scaled[64:])


# --- the tiny files ------------------------------------------------------------------------

def test_tiny_files_have_the_real_layouts(files):
    with_keys = {name: load_file(path) for name, path in files.items()}
    assert sorted(k[len("double_blocks.0."):] for k in with_keys["transformer"] if k.startswith("double_blocks.0.")) \
        == DOUBLE_BLOCK_KEYS
    assert "guidance_in.in_layer.weight" in with_keys["transformer"]
    assert "text_model.embeddings.token_embedding.weight" in with_keys["clip_l"]
    assert "text_model.encoder.layers.11.mlp.fc2.bias" in with_keys["clip_l"]
    assert "shared.weight" in with_keys["t5xxl"] and "encoder.embed_tokens.weight" not in with_keys["t5xxl"]
    assert "encoder.block.23.layer.1.DenseReluDense.wi_1.weight" in with_keys["t5xxl"]
    assert with_keys["ae"]["decoder.conv_in.weight"].shape[1] == 16
    assert with_keys["ae"]["encoder.mid.attn_1.q.weight"].ndim == 4  # conv 1x1, as BFL's ae.safetensors
    assert "quant_conv.weight" not in with_keys["ae"]


def test_tiny_files_load_and_run_like_the_preset(files, preset):
    comps = _load(files["transformer"], clip_l=files["clip_l"], t5xxl=files["t5xxl"], ae=files["ae"])
    parts = {"transformer": comps.denoiser, "vae": comps.vae, "text_encoder": comps.text_encoders[0],
             "text_encoder_2": comps.text_encoders[1]}
    for name, model in parts.items():
        ours, ref = model.state_dict(), preset[name].state_dict()
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref), name
    assert comps.denoiser.config == preset["transformer"].config and comps.vae.config == preset["vae"].config
    for ours, ref in zip(comps.text_encoders, (preset["text_encoder"], preset["text_encoder_2"])):
        assert ours.config.to_dict() == ref.config.to_dict()  # configs read back from the shapes alone
    t5 = comps.text_encoders[1]
    assert t5.shared.weight is t5.encoder.embed_tokens.weight
    family = get_family("flux")
    tokens = family.tokenize(comps, ["a photo of a cat"], None)
    assert tokens[1][0, :5].tolist() == preset["tokenizer_2"]("a photo of a cat").input_ids[:5]
    with torch.no_grad():
        ids = tokens[0]
        assert torch.equal(parts["text_encoder"](ids).pooler_output, preset["text_encoder"](ids).pooler_output)
        ids2 = tokens[1][:, :8]
        assert torch.equal(t5(ids2).last_hidden_state, preset["text_encoder_2"](ids2).last_hidden_state)
        image = torch.rand(1, 3, 32, 32) * 2 - 1
        assert torch.equal(comps.vae.encode(image).latent_dist.mean, preset["vae"].encode(image).latent_dist.mean)
        gen = torch.Generator().manual_seed(1)
        kwargs = dict(hidden_states=torch.randn(1, 4, 64, generator=gen),
                      encoder_hidden_states=torch.randn(1, 3, 32, generator=gen),
                      pooled_projections=torch.randn(1, 32, generator=gen), timestep=torch.tensor([0.5]),
                      img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3), guidance=torch.tensor([1.0]),
                      return_dict=False)
        assert torch.equal(comps.denoiser(**kwargs)[0], preset["transformer"](**kwargs)[0])


def test_component_flags_replace_parts_of_a_preset(files):
    comps = _load("tiny:flux", t5xxl=files["t5xxl"])
    assert type(comps.text_encoders[1]).__name__ == "T5EncoderModel"
    assert comps.text_encoders[1].config.num_layers == 24


def test_a_part_given_as_a_file_is_not_read_from_the_diffusers_folder(files, tmp_path, tiny_flux):
    import shutil

    folder = str(tmp_path / "flux")
    get_family("flux").save_checkpoint(tiny_flux, folder)
    shutil.rmtree(os.path.join(folder, "text_encoder_2"))
    os.makedirs(os.path.join(folder, "text_encoder_2"))  # present but empty: loading it would fail
    comps = _load(folder, t5xxl=files["t5xxl"])
    assert type(comps.text_encoders[1]).__name__ == "T5EncoderModel"


def test_save_checkpoint_safetensors_writes_the_bfl_transformer(files, tmp_path, tiny_flux_copy):
    comps = tiny_flux_copy  # changed below
    with torch.no_grad():
        comps.denoiser.transformer_blocks[0].attn.to_k.weight.add_(1.0)  # as a merge would change it
    family = get_family("flux")
    out = str(tmp_path / "merged.safetensors")
    family.save_checkpoint(comps, out, torch.float16)
    saved, original = load_file(out), load_file(files["transformer"])
    assert saved.keys() == original.keys()
    assert saved["double_blocks.0.img_attn.qkv.weight"].dtype == torch.float16
    back = _load(out, clip_l=files["clip_l"], t5xxl=files["t5xxl"], ae=files["ae"])
    expected = {k: v.half().float() for k, v in comps.denoiser.state_dict().items()}
    got = back.denoiser.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    from library.core.errors import UserError

    with pytest.raises(UserError, match=r"merged\.ckpt: cannot save a flux model as ckpt \(--save_model_as takes safetensors, diffusers, "):
        family.save_checkpoint(comps, str(tmp_path / "merged.ckpt"))


def test_merge_lora_into_a_bfl_file(files, tmp_path):
    from tools.merge_lora import main

    gen = torch.Generator().manual_seed(3)
    down, up = torch.randn(4, 32, generator=gen), torch.randn(96, 4, generator=gen)
    lora = str(tmp_path / "lora.safetensors")
    name = "lora_unet_double_blocks_1_txt_attn_qkv"
    save_file({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(2.0)},
              lora)
    merged = str(tmp_path / "merged.safetensors")
    argv = ["--model_family", "flux", "--sd_model", files["transformer"], "--save_to", merged, "--models", lora,
            "--ratios", "0.5", *_flags(files)]
    assert main(argv) == 0
    before, after = load_file(files["transformer"]), load_file(merged)
    key = "double_blocks.1.txt_attn.qkv.weight"
    torch.testing.assert_close(after[key] - before[key], 0.5 * (2.0 / 4) * up @ down, rtol=0, atol=1e-5)
    assert all(torch.equal(after[k], before[k]) for k in before if k != key)


# --- training ------------------------------------------------------------------------------

def test_lora_training_from_bfl_files_equals_the_diffusers_folder_run(files, tmp_path, tiny_flux_folder):
    folder = tiny_flux_folder  # tools/make_tiny_model.py's diffusers folder
    data = make_dataset(str(tmp_path), n=2)
    loras = []
    for name, model, extra in (("bfl", files["transformer"], _flags(files)), ("folder", folder, [])):
        argv = base_args(data, str(tmp_path / name), model, steps=2, extra=TRAIN_FLAGS + extra)
        loras.append(load_file(make_trainer(argv, "flux").run()))
    from_bfl, from_folder = loras
    assert len(from_bfl) == 29 * 3 and from_bfl.keys() == from_folder.keys()
    assert all(torch.equal(from_bfl[k], from_folder[k]) for k in from_bfl)  # same weights, same seed: same LoRA
    assert from_bfl["lora_unet_single_blocks_2_linear1.lora_up.weight"].abs().sum() > 0


# --- errors --------------------------------------------------------------------------------

def _cli_error(tmp_path, capsys, model, extra) -> str:
    from library.cli.entry import run_training

    data = make_dataset(str(tmp_path), n=1)
    assert run_training("flux", "test", base_args(data, str(tmp_path / "out"), model, steps=1, extra=extra)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_missing_t5xxl_stops_with_one_line_before_the_data_is_read(files, tmp_path, capsys):
    from library.cli.entry import run_training

    argv = base_args(str(tmp_path / "no_data_here"), str(tmp_path / "out"), files["transformer"], steps=1,
                     extra=["--clip_l", files["clip_l"], "--ae", files["ae"]])
    assert run_training("flux", "test", argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --t5xxl: required with a BFL single-file transformer ({files['transformer']}); "
        "give a T5-XXL text encoder (t5xxl_fp16.safetensors)")


def test_sdxl_file_as_the_flux_model_stops_with_one_line(files, tmp_path, capsys, tiny_sdxl_file):
    sdxl = tiny_sdxl_file  # written by write_sdxl_preset
    err = _cli_error(tmp_path, capsys, sdxl, _flags(files))
    assert err == (f"error: --pretrained_model_name_or_path {sdxl}: expected a FLUX.1 transformer in the BFL layout "
                   "(double_blocks.* keys), found an SDXL checkpoint")


def test_t5_token_length_over_512_stops_with_one_line(tmp_path, capsys):
    err = _cli_error(tmp_path, capsys, "tiny:flux", ["--t5xxl_max_token_length", "513"])
    assert err == "error: --t5xxl_max_token_length: expected an integer from 1 to 512 (T5-XXL's limit), got 513"


@pytest.mark.parametrize("flag, given, found", [
    ("t5xxl", "clip_l", "a CLIP text encoder"),
    ("clip_l", "t5xxl", "a T5 text encoder"),
    ("ae", "transformer", "a FLUX.1 transformer"),
])
def test_wrong_component_file_names_the_flag_and_what_it_holds(files, flag, given, found):
    flags = {f: files[f] for f in ("clip_l", "t5xxl", "ae")}
    flags[flag] = files[given]
    with pytest.raises(ModelLoadError) as e:
        _load(files["transformer"], **flags)
    assert str(e.value).startswith(f"--{flag} {files[given]}: expected ")
    assert str(e.value).endswith(f", found {found}")


def test_sd_vae_as_ae_is_refused(files, tmp_path, tiny_sd1):
    from library.families.common import ldm_layout as ldm

    vae = tiny_sd1.vae.state_dict()
    path = str(tmp_path / "sd_vae.safetensors")
    save_file({k: v.contiguous() for k, v in ldm.push(vae, ldm.vae_key_map(vae.keys(), "")).items()}, path)
    with pytest.raises(ModelLoadError, match=r"^--ae .*sd_vae\.safetensors: expected the FLUX.1 autoencoder with 16 "
                                             r"latent channels, found 4 \(an SD/SDXL VAE\?\)$"):
        _load(files["transformer"], clip_l=files["clip_l"], t5xxl=files["t5xxl"], ae=path)


# --- the other tools take the component files too ------------------------------------------------------
def test_generate_and_extract_take_the_component_files(files, tmp_path):
    from safetensors import safe_open

    from tools import extract_lora_from_models, generate

    out = tmp_path / "images"
    assert generate.main(["--flux", "--ckpt", files["transformer"], *_flags(files), "--outdir", str(out),
                          "--prompt", "a red square", "--W", "64", "--H", "64", "--steps", "2", "--seed", "1"]) == 0
    assert len([p for p in os.listdir(out) if p.endswith(".png")]) == 1

    tuned = str(tmp_path / "tuned.safetensors")
    state = load_file(files["transformer"])
    state["single_blocks.0.linear2.weight"] += 0.05 * torch.ones_like(state["single_blocks.0.linear2.weight"])
    save_file(state, tuned)
    lora = str(tmp_path / "extracted.safetensors")
    assert extract_lora_from_models.main(["--model_family", "flux", "--model_org", files["transformer"],
                                          "--model_tuned", tuned, *_flags(files), "--dim", "2",
                                          "--save_to", lora]) == 0
    changed = "lora_unet_single_blocks_0_linear2"
    with safe_open(lora, "pt") as f:
        names = {k.split(".")[0] for k in f.keys()}
        delta = {n: f.get_tensor(f"{n}.lora_up.weight") @ f.get_tensor(f"{n}.lora_down.weight") for n in names}
    assert len(names) == 37  # every transformer layer (29 in blocks, 8 outside); CLIP-L did not change
    torch.testing.assert_close(delta.pop(changed), 0.05 * torch.ones_like(state["single_blocks.0.linear2.weight"]),
                               rtol=0, atol=1e-3)
    assert max(d.abs().max().item() for d in delta.values()) < 1e-4


def test_block_counts_are_read_without_loading_weights(files, tmp_path, tiny_flux_folder):
    from library.families.flux.loading import block_counts

    folder = tiny_flux_folder
    assert block_counts("tiny:flux") == block_counts(files["transformer"]) == block_counts(folder) == (2, 3)
    assert block_counts("random:flux-dev") == (19, 38)
    assert block_counts(str(tmp_path / "missing.safetensors")) is None
