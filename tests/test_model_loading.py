"""Loading SD 1.x / 2.x: diffusers folders, LDM single files (.safetensors / .ckpt), --vae, errors, flags."""

import argparse
import os

import pytest
import torch
from safetensors.torch import save_file

from library.cli.config_file import check_choices
from library.cli.model import (
    add_model_arguments,
    load_options_from_args,
    text_options_from_args,
)
from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import LoadOptions, ModelLoadError
from library.families.common.loading import find_tokenizer
from library.families.sd.saving import ldm_state_dict
from tools.make_tiny_model import main as make_tiny_model

FAMILY = get_family("sd")


@pytest.fixture
def presets(tiny_sd1, tiny_sd2):
    return {"tiny:sd1": tiny_sd1, "tiny:sd2": tiny_sd2}


@torch.no_grad()
def outputs(comps):
    """UNet, VAE-decode and text-encoder outputs on fixed inputs."""
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 4, 4, generator=g)
    tokens = FAMILY.tokenize(comps, ["a photo of a cat"], None)
    text = FAMILY.encode_text(comps, tokens, None).tensors["encoder_hidden_states"]
    unet = comps.denoiser(latents, torch.tensor([10]), text).sample
    return text, unet, comps.vae.decode(latents).sample


def assert_same_model(a, b):
    for x, y in zip(outputs(a), outputs(b)):
        assert torch.equal(x, y)
    for pa, pb in ((a.denoiser, b.denoiser), (a.vae, b.vae), (a.text_encoders[0], b.text_encoders[0])):
        sa, sb = pa.state_dict(), pb.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name,suffix", [("tiny:sd1", ".safetensors"), ("tiny:sd1", ".ckpt"),
                                         ("tiny:sd2", ".safetensors"), ("tiny:sd2", ".ckpt")])
def test_single_file_round_trip(presets, tmp_path, name, suffix):
    path = str(tmp_path / f"model{suffix}")
    make_tiny_model(["--family", name.split(":")[1], "--out", path, "--single_file"])
    loaded = FAMILY.load(LoadOptions(path))
    assert loaded.v2 == (name == "tiny:sd2") and loaded.model_path == path
    assert loaded.denoiser.config.block_out_channels == (32, 64, 128, 128)
    assert_same_model(presets[name], loaded)


def test_ldm_key_layout(presets):
    sd1 = presets["tiny:sd1"]
    state = ldm_state_dict(sd1.denoiser, sd1.vae, sd1.text_encoders[0], v2=False)
    counts = [sum(k.startswith(p) for k in state) for p in ("model.diffusion_model.", "first_stage_model.",
                                                            "cond_stage_model.transformer.text_model.")]
    assert counts == [686, 248, 196]  # as in the real SD 1.5 checkpoint
    unet = sd1.denoiser
    assert torch.equal(state["model.diffusion_model.output_blocks.2.1.conv.weight"], unet.up_blocks[0].upsamplers[0].conv.weight)
    assert torch.equal(state["model.diffusion_model.output_blocks.5.2.conv.weight"], unet.up_blocks[1].upsamplers[0].conv.weight)
    assert torch.equal(state["model.diffusion_model.input_blocks.3.0.op.weight"], unet.down_blocks[0].downsamplers[0].conv.weight)
    assert torch.equal(state["model.diffusion_model.middle_block.2.in_layers.2.weight"], unet.mid_block.resnets[1].conv1.weight)
    assert state["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (128, 128, 1, 1)
    assert torch.equal(state["first_stage_model.decoder.up.3.upsample.conv.weight"], sd1.vae.decoder.up_blocks[0].upsamplers[0].conv.weight)
    # diffusers' own LDM converter reads our layout back to the same UNet and VAE.
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
    )

    back = convert_ldm_unet_checkpoint(dict(state), dict(unet.config))
    assert all(torch.equal(back[k], v) for k, v in unet.state_dict().items())
    back = convert_ldm_vae_checkpoint(dict(state), dict(sd1.vae.config))
    assert all(torch.equal(back[k].reshape(v.shape), v) for k, v in sd1.vae.state_dict().items())


def test_open_clip_layout(presets):
    sd2 = presets["tiny:sd2"]
    te = sd2.text_encoders[0]
    state = ldm_state_dict(sd2.denoiser, sd2.vae, te, v2=True)
    attn = te.encoder.layers[0].self_attn
    fused = state["cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight"]
    assert torch.equal(fused, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    # 23 diffusers layers are written as OpenCLIP-H's 24 (the last duplicated), as real SD2 files hold.
    assert "cond_stage_model.model.transformer.resblocks.23.ln_1.weight" in state
    assert "cond_stage_model.model.transformer.resblocks.24.ln_1.weight" not in state
    assert state["cond_stage_model.model.text_projection"].shape == (32, 32)
    assert state["cond_stage_model.model.positional_embedding"].shape == (77, 32)


def test_diffusers_folder_round_trip_and_pipeline(tiny_sd2v, tmp_path):
    out = str(tmp_path / "tiny-sd2-v")
    assert make_tiny_model(["--family", "sd2-v", "--out", out]) == 0
    assert sorted(os.listdir(out)) == ["model_index.json", "scheduler", "text_encoder", "tokenizer", "unet", "vae"]
    loaded = FAMILY.load(LoadOptions(out, v_parameterization=True))
    assert loaded.v2 and loaded.v_parameterization
    assert loaded.tokenizers[0].pad_token_id == 0
    assert_same_model(tiny_sd2v, loaded)

    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(out)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    image = pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="np").images
    assert image.shape == (1, 64, 64, 3)


def test_rewriting_a_folder_replaces_it(tmp_path):
    out = str(tmp_path / "m")
    make_tiny_model(["--family", "sd1", "--out", out])
    make_tiny_model(["--family", "sd1", "--out", out])
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no temporary folders left behind


def test_vae_override(presets, tmp_path):
    vae = presets["tiny:sd1"].vae
    changed = {k: v + 1.0 for k, v in vae.state_dict().items()}
    state = ldm_state_dict(presets["tiny:sd1"].denoiser, vae, presets["tiny:sd1"].text_encoders[0], v2=False)
    ldm_vae = {k: v + 1.0 for k, v in state.items() if k.startswith("first_stage_model.")}
    save_file(ldm_vae, str(tmp_path / "prefixed.safetensors"))
    bare = {k[len("first_stage_model."):]: v for k, v in ldm_vae.items()}
    torch.save({"state_dict": bare}, str(tmp_path / "bare.ckpt"))
    for name in ("prefixed.safetensors", "bare.ckpt"):
        loaded = FAMILY.load(LoadOptions("tiny:sd1", vae=str(tmp_path / name)))
        got = loaded.vae.state_dict()
        assert all(torch.equal(got[k], changed[k]) for k in changed)
        assert loaded.vae_path == str(tmp_path / name)
    vae.save_pretrained(str(tmp_path / "vae_folder"))
    loaded = FAMILY.load(LoadOptions("tiny:sd2", vae=str(tmp_path / "vae_folder")))
    assert all(torch.equal(loaded.vae.state_dict()[k], v) for k, v in vae.state_dict().items())
    save_file({"x": torch.zeros(1)}, str(tmp_path / "notvae.safetensors"))
    with pytest.raises(ModelLoadError, match=r"--vae .*notvae.safetensors: expected VAE keys .* found x$"):
        FAMILY.load(LoadOptions("tiny:sd1", vae=str(tmp_path / "notvae.safetensors")))


def test_hub_id_without_cache_is_one_line_error():
    with pytest.raises(ModelLoadError) as e:
        FAMILY.load(LoadOptions("runwayml/stable-diffusion-v1-5"))
    assert str(e.value) == ("cannot reach the Hugging Face hub for 'runwayml/stable-diffusion-v1-5': download the "
                            "model and pass a local path (a diffusers folder or a .safetensors/.ckpt file)")


def test_bad_model_files(tmp_path):
    sdxl = {"conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight": torch.zeros(2, 2),
            "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 4, 3, 3)}
    save_file(sdxl, str(tmp_path / "sdxl.safetensors"))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a checkpoint" * 10)
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(1)}, str(tmp_path / "lora.safetensors"))
    (tmp_path / "folder").mkdir()
    cases = {
        str(tmp_path / "sdxl.safetensors"): "sdxl.safetensors: this is an SDXL checkpoint (conditioner.embedders.* keys)",
        str(garbage): "garbage.safetensors: cannot read as a .safetensors/.ckpt checkpoint",
        str(tmp_path / "lora.safetensors"): "lora.safetensors: not an SD 1.x/2.x checkpoint: expected "
                                            "model.diffusion_model.*",
        str(tmp_path / "missing.ckpt"): "missing.ckpt does not exist",
        str(tmp_path / "folder"): "folder: not a diffusers model folder (no model_index.json)",
        "tiny:sd9": "unknown preset 'tiny:sd9'",
    }
    for path, message in cases.items():
        with pytest.raises(ModelLoadError) as e:
            FAMILY.load(LoadOptions(path))
        assert message in str(e.value) and "\n" not in str(e.value)


def test_single_file_tokenizer_lookup(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="openai/clip-vit-large-patch14 tokenizer is not cached locally"):
        find_tokenizer(False, 49408, None, "real.safetensors")
    from library.families.common import loading
    from library.families.common.tiny import build_tokenizer

    # Pretend the tiny vocabulary is a real one, found only in --tokenizer_cache_dir.
    monkeypatch.setattr(loading, "tiny_vocab_size", lambda: -1)
    build_tokenizer(False).save_pretrained(str(tmp_path / "openai_clip-vit-large-patch14"))
    tok = find_tokenizer(False, 987, str(tmp_path), "real.safetensors")
    assert tok("a cat").input_ids == build_tokenizer(False)("a cat").input_ids
    with pytest.raises(ModelLoadError, match="stable-diffusion-2 tokenizer is not cached"):
        find_tokenizer(True, 987, str(tmp_path), "real.safetensors")


def test_model_flags():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    ns = parser.parse_args(["--pretrained_model_name_or_path", "tiny:sd2", "--v2", "--clip_skip", "2",
                            "--max_token_length", "225", "--no_half_vae", "--vae", "v.safetensors"])
    ns.mixed_precision = "fp16"
    opts = load_options_from_args(ns)
    assert (opts.pretrained_model_name_or_path, opts.vae, opts.v2, opts.v_parameterization) == (
        "tiny:sd2", "v.safetensors", True, False)
    assert (opts.dtype, opts.vae_dtype) == (torch.float16, torch.float32)
    assert text_options_from_args(ns).max_token_length == 225 and text_options_from_args(ns).clip_skip == 2
    ns.no_half_vae = False
    assert load_options_from_args(ns).vae_dtype == torch.float16
    with pytest.raises(ConfigError, match=r"^--max_token_length: expected one of 75, 150, 225, got 100$"):
        check_choices({"max_token_length": 100}, parser)  # a config file's value, checked as argparse checks flags
    ns.pretrained_model_name_or_path = None
    with pytest.raises(ConfigError, match="--pretrained_model_name_or_path: required"):
        load_options_from_args(ns)
