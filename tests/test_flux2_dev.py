"""FLUX.2 [dev]: tiny:flux2_dev written as the files users have (the diffusers folder with a Mistral3 text encoder, the
DiT / Mistral / AE single files) and loaded back by the real loaders; text, one step and 3 sampling steps as diffusers'
Flux2Pipeline (guidance embedding); our LoRA in Flux2Pipeline.load_lora_weights; a LoRA training run, generation with
the LoRA, a full fine-tune saving a file that loads back; the one-line errors; and FLUX.2's timestep default against
musubi-tuner's flux2_shift at two resolutions."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import LoadOptions, ModelLoadError
from library.families.flux2.configs import SYSTEM_MESSAGE
from library.families.flux2.family import patchify
from library.families.flux2.generate import flux2_sigmas
from library.families.flux2.loading import write_flux2_preset
from library.families.flux2.options import Flux2FlowOptions, Flux2Options
from library.objectives.flow import FlowMatchScheme
from networks.lora import create_network_from_weights
from tests.train_helpers import (apply_lora_file, assert_lora_changes_generation, assert_only_denoiser_moved,
                                 assert_pipeline_lora_predicts_as_ours, assert_same_weights, base_args,
                                 diffusers_loading_warnings,
                                 fine_tune_one_step, make_dataset, make_trainer, random_lora_file)

# the tiny tokenizer spells BFL's system prompt in 134 tokens (the real one in far fewer): room for a caption
TOKENS = 160


@pytest.fixture(scope="module")
def dev_files(tmp_path_factory):
    return write_flux2_preset("tiny:flux2_dev", str(tmp_path_factory.mktemp("flux2-dev-files")))


@pytest.fixture(scope="module")
def tiny_dev():
    return get_family("flux2").load(LoadOptions("tiny:flux2_dev", family_options=Flux2Options(
        mistral3_max_token_length=TOKENS)))


def test_dev_files_load_through_the_real_loaders(tmp_path, dev_files, tiny_dev):
    """The folder (by Flux2Pipeline.from_pretrained and by the family), the DiT file (by diffusers' from_single_file
    and by the family) with --mistral3 as one file (transformers' keys, or ComfyUI's model.*) and as FLUX.2-dev's
    shards, and --ae give the preset's weights; detection names the folder and the DiT file flux2;
    the text encoder kept is Mistral3's language model (40 layers, head width 128)."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel

    family = get_family("flux2")
    assert type(tiny_dev.text_encoders[0]).__name__ == "MistralModel"
    assert tiny_dev.text_encoders[0].config.num_hidden_layers == 40 and tiny_dev.denoiser.config.guidance_embeds
    pipe = Flux2Pipeline.from_pretrained(dev_files["diffusers"])
    assert_same_weights(pipe.transformer, tiny_dev.denoiser)
    assert_same_weights(pipe.text_encoder.model.language_model, tiny_dev.text_encoders[0])
    by_diffusers = Flux2Transformer2DModel.from_single_file(
        dev_files["dit"], config=os.path.join(dev_files["diffusers"], "transformer"))
    assert_same_weights(by_diffusers, tiny_dev.denoiser)
    pipe.text_encoder.save_pretrained(str(tmp_path / "te"), max_shard_size="300KB")
    shards = sorted(n for n in os.listdir(tmp_path / "te") if n.endswith(".safetensors"))
    assert len(shards) > 2 and shards[0].endswith("-00001-of-%05d.safetensors" % len(shards))
    with safe_open(dev_files["mistral3"], "pt") as f:
        keys = set(f.keys())
    assert {"language_model.model.layers.39.self_attn.k_proj.weight", "multi_modal_projector.linear_1.weight",
            "vision_tower.patch_conv.weight"} <= keys
    from library.core.safetensors_io import write_safetensors

    comfy = str(tmp_path / "mistral_comfy.safetensors")  # ComfyUI's text-encoder layout: the language model as model.*
    write_safetensors({"model." + k: v for k, v in tiny_dev.text_encoders[0].state_dict().items()}, comfy)
    for text in (dev_files["mistral3"], str(tmp_path / "te" / shards[0]), comfy):
        single = family.load(LoadOptions(dev_files["dit"], family_options=Flux2Options(mistral3=text,
                                                                                         ae=dev_files["ae"])))
        for part in ("denoiser", "vae"):
            assert_same_weights(getattr(single, part), getattr(tiny_dev, part))
        assert_same_weights(single.text_encoders[0], tiny_dev.text_encoders[0])
    from library.families.detect import detect_family

    assert [detect_family(p) for p in (dev_files["diffusers"], dev_files["dit"])] == ["flux2"] * 2
    folder = family.load(LoadOptions(dev_files["diffusers"]))
    assert_same_weights(folder.denoiser, tiny_dev.denoiser)
    assert_same_weights(folder.text_encoders[0], tiny_dev.text_encoders[0])


def test_dev_errors_are_one_line(dev_files):
    family = get_family("flux2")
    with pytest.raises(ModelLoadError, match=r"^--mistral3: required with a FLUX.2 \[dev\] DiT file"):
        family.load(LoadOptions(dev_files["dit"], family_options=Flux2Options(ae=dev_files["ae"])))
    klein = write_flux2_preset("tiny:flux2", os.path.join(os.path.dirname(dev_files["dit"]), "klein"))
    with pytest.raises(ModelLoadError, match=r"^--qwen3: .* is FLUX.2 \[dev\], whose text encoder is given with "
                                             r"--mistral3$"):
        family.load(LoadOptions(dev_files["dit"], family_options=Flux2Options(qwen3=klein["qwen3"])))
    with pytest.raises(ModelLoadError, match=r"^--mistral3: .* is FLUX.2 \[klein\], whose text encoder is given "
                                             r"with --qwen3$"):
        family.load(LoadOptions(klein["dit"], family_options=Flux2Options(mistral3=dev_files["mistral3"])))
    with pytest.raises(ModelLoadError, match=r"^--mistral3 .*: expected a Mistral-Small-3.1 text encoder"):
        family.load(LoadOptions(dev_files["dit"], family_options=Flux2Options(mistral3=dev_files["ae"])))
    with pytest.raises(ModelLoadError, match=r"^tiny:flux2_dev: a FLUX.2 \[dev\] DiT .* with a Qwen3 text encoder"):
        family.load(LoadOptions("tiny:flux2_dev", family_options=Flux2Options(qwen3=klein["qwen3"])))
    with pytest.raises(ModelLoadError, match=r"^--model_version klein-base-4b: the files are FLUX.2 \[dev\]"):
        family.load(LoadOptions("tiny:flux2_dev", family_options=Flux2Options(model_version="klein-base-4b")))
    with pytest.raises(ModelLoadError, match=r"^--model_version dev: the files are FLUX.2 \[klein\]"):
        family.load(LoadOptions("tiny:flux2", family_options=Flux2Options(model_version="dev")))
    from library.core.safetensors_io import write_safetensors

    folder = os.path.join(os.path.dirname(dev_files["dit"]), "shards")
    os.makedirs(folder, exist_ok=True)
    ae = load_file(dev_files["ae"])
    for i in (1, 2):
        write_safetensors(ae, os.path.join(folder, f"model-0000{i}-of-00003.safetensors"))
    first = os.path.join(folder, "model-00001-of-00003.safetensors")
    with pytest.raises(ModelLoadError, match=r"^--mistral3 .*: shard model-00003-of-00003.safetensors of 3 is "
                                             r"missing beside it$"):
        family.load(LoadOptions(dev_files["dit"], family_options=Flux2Options(mistral3=first)))
    write_safetensors(ae, os.path.join(folder, "model-00003-of-00003.safetensors"))
    with pytest.raises(ModelLoadError, match=r"^--mistral3 .*: expected a Mistral-Small-3.1 text encoder .*, found "
                                             r"none in its 3 shards$"):
        family.load(LoadOptions(dev_files["dit"], family_options=Flux2Options(mistral3=first)))
    with pytest.raises(ConfigError, match=r"^--mistral3_max_token_length: expected an integer from 16"):
        Flux2Options(mistral3_max_token_length=8).check()
    with pytest.raises(ConfigError, match=r"^--guidance_scale: expected a number >= 0"):
        Flux2Options(guidance_scale=-1.0).check()


def test_dev_text_one_step_and_sampling_are_the_pipelines(dev_files, tiny_dev):
    """Mistral's layers 10/20/30 of BFL's system prompt + caption in the tokenizer's chat template are
    Flux2Pipeline.encode_prompt's embeddings (bit for bit); one DiT call with guidance equals the pipeline's
    transformer call (bit for bit: the same ops); 3 Euler steps at guidance 4 end at the pipeline's latents (measured
    difference 0.0; 1e-6 allowed, the σ schedule is computed by other code). The training guidance default is 1.0."""
    from diffusers import Flux2Pipeline

    family = get_family("flux2")
    c = tiny_dev
    captions = ["a red cube on a hill", "a cat"]
    ids, mask = family.tokenize(c, captions, None)
    assert ids.shape == (2, TOKENS) and ids[0, 0] == 1  # <s>
    assert c.tokenizers[0].decode(ids[1][mask[1].bool()]) == (
        f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a cat[/INST]")
    text = family.encode_text(c, [ids, mask], None)
    pipe = Flux2Pipeline.from_pretrained(dev_files["diffusers"])
    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt(captions, device="cpu", max_sequence_length=TOKENS)
    assert embeds.shape == (2, TOKENS, 3 * 32)
    torch.testing.assert_close(text.tensors["hidden_state"], embeds, rtol=0, atol=0)
    noise = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = patchify(noise).reshape(2, 128, 16).permute(0, 2, 1)
        latent_ids = pipe._prepare_latent_ids(patchify(noise))
        for guidance in (1.0, 3.5):
            theirs_v = pipe.transformer(hidden_states=packed, timestep=torch.full((2,), 0.7), guidance=torch.full(
                (2,), guidance), encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=latent_ids,
                return_dict=False)[0]
            batch = {} if guidance == 1.0 else {"guidance": torch.full((2,), guidance)}  # 1.0: the default
            ours_v = family.predict(c, noise, torch.full((2,), 700.0), text, batch)
            torch.testing.assert_close(patchify(ours_v).reshape(2, 128, 16).permute(0, 2, 1), theirs_v, rtol=0,
                                       atol=0)
        assert (family.predict(c, noise, torch.full((2,), 700.0), text, {"guidance": torch.full((2,), 4.0)})
                - ours_v).abs().max() > 1e-4  # the guidance value reaches the model
        theirs = pipe(prompt_embeds=embeds, latents=patchify(noise), height=64, width=64, num_inference_steps=3,
                      guidance_scale=4.0, output_type="latent", return_dict=False)[0]
        sigmas = flux2_sigmas(3, 16)
        latents = noise
        for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            v = family.predict(c, latents, torch.full((2,), sigma * 1000), text, {"guidance": torch.full((2,), 4.0)})
            latents = latents + (sigma_next - sigma) * v
    # Flux2Pipeline's "latent" output: the normalised latents, 2x2 patches packed into tokens
    assert theirs.shape == (2, 16, 128)
    torch.testing.assert_close(patchify(latents).reshape(2, 128, 16).permute(0, 2, 1), theirs, rtol=0, atol=1e-6)


def test_diffusers_flux2_pipeline_loads_our_dev_lora_with_no_unexpected_keys(tmp_path):
    """Flux2Pipeline.load_lora_weights reads our kohya-named dev LoRA: every key placed (no unexpected key, no module
    of ours left out) and the transformer predicts what our network predicts (measured 0.0; 1e-6 allowed)."""
    from diffusers import Flux2Pipeline

    from library.families.flux2.loading import scheduler

    family = get_family("flux2")
    options = Flux2Options(mistral3_max_token_length=TOKENS)
    ours, theirs = (family.load(LoadOptions("tiny:flux2_dev", family_options=options)) for _ in range(2))
    path = random_lora_file(family, ours, str(tmp_path / "lora.safetensors"))
    apply_lora_file(family, ours, path)
    pipe = Flux2Pipeline(scheduler=scheduler(), vae=theirs.vae, text_encoder=None, tokenizer=theirs.tokenizers[0],
                         transformer=theirs.denoiser)
    state = {k: v for k, v in load_file(path).items() if k.startswith("lora_unet_")}
    assert len(state) == 3 * (8 * 2 + 2 * 3)
    lora_state = Flux2Pipeline.lora_state_dict(dict(state))
    pipe.load_lora_weights(dict(state))
    adapter_keys = {k for k in theirs.denoiser.state_dict() if ".lora_A." in k or ".lora_B." in k}
    expected = {k.replace("transformer.", "", 1).replace(".lora_A.weight", ".lora_A.default_0.weight")
                .replace(".lora_B.weight", ".lora_B.default_0.weight") for k in lora_state}
    assert expected == adapter_keys  # no unexpected key and none missing
    assert_pipeline_lora_predicts_as_ours(family, ours, theirs, 32)


def test_tiny_flux2_dev_lora_trains_and_generates(tmp_path, dev_files):
    """flux2_train_network.py on tiny:flux2_dev: 2 steps with networks.lora_flux2 (text outputs and latents cached);
    the file records flux-2-dev, guidance 1.0 and flux_shift (given as musubi-tuner's flux2_shift); tools/generate.py
    makes an image with the LoRA (--g 4 by default), which the LoRA changes."""
    data = make_dataset(str(tmp_path), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:flux2_dev", steps=2, extra=[
        "--network_module", "networks.lora_flux2", "--mistral3_max_token_length", str(TOKENS),
        "--cache_text_encoder_outputs", "--cache_latents", "--network_train_unet_only",
        "--timestep_sampling", "flux2_shift"]), "flux2")
    path = trainer.run()
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        up = f.get_tensor("lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight")
        assert len(list(f.keys())) == 3 * 22
    assert up.abs().sum() > 0
    assert (metadata["modelspec.architecture"], metadata["ss_guidance_scale"], metadata["ss_timestep_sampling"]) \
        == ("flux-2-dev/lora", "1.0", "flux_shift")
    assert_lora_changes_generation(tmp_path, dev_files["diffusers"], "networks.lora_flux2", path)


def test_dev_full_fine_tune_saves_a_dit_file_that_loads_back(tmp_path, dev_files, tiny_dev):
    """flux2_train.py from the dev folder: the saved DiT has exactly the DiT file's keys (guidance_in included),
    loads back with --mistral3, and only the DiT moved."""
    path, _ = fine_tune_one_step(tmp_path, "flux2", dev_files["diffusers"], [
        "--mistral3_max_token_length", str(TOKENS), "--cache_text_encoder_outputs", "--cache_latents"],
        "flux-2-dev", dev_files["dit"])
    assert "guidance_in.in_layer.weight" in load_file(path)
    loaded = get_family("flux2").load(LoadOptions(path, family_options=Flux2Options(
        mistral3=dev_files["mistral3"], ae=dev_files["ae"])))
    assert_only_denoiser_moved(loaded, tiny_dev)


def _musubi_flux2_shift(u_normal: torch.Tensor, packed_h: int, packed_w: int) -> torch.Tensor:
    """musubi-tuner's trainer_base.py, --timestep_sampling flux2_shift, sigmoid_scale 1, on its FLUX.2 latents (the
    AE's 128 channels at 1/16 size): mu = get_lin_function(y1=0.5, y2=1.15)(h * w); t = sigmoid(u);
    t = t * shift / (1 + (shift - 1) * t), shift = e^mu."""
    m = (1.15 - 0.5) / (4096 - 256)
    mu = m * (packed_h * packed_w) + (0.5 - m * 256)
    shift = math.exp(mu)
    t = u_normal.sigmoid()
    return (t * shift) / (1 + (shift - 1) * t)


@pytest.mark.parametrize("pixels, mu", [((1024, 1024), 1.15), ((768, 512), 0.7166666666666667)])
def test_flux2_timestep_default_is_musubi_flux2_shift(pixels, mu):
    """The default sampling on our (32, H/8, W/8) latents gives musubi-tuner's flux2_shift σ on its (128, H/16, W/16)
    ones: 1024² -> 4096 tokens, μ 1.15 (shift 3.158); 768x512 -> 1536 tokens, μ 0.71667 (shift 2.048); the flag
    value flux2_shift is taken as the same. Exact numbers at u = 0 (σ = shift / (1 + shift))."""
    h, w = pixels[1] // 8, pixels[0] // 8
    tokens = (h // 2) * (w // 2)
    assert math.isclose(0.5 + (tokens - 256) * 0.65 / 3840, mu, rel_tol=0, abs_tol=1e-12)
    for name in ("flux_shift", "flux2_shift"):
        options = Flux2FlowOptions(timestep_sampling=name)
        scheme = FlowMatchScheme(options)
        assert Flux2FlowOptions().timestep_sampling == "flux_shift" and options.timestep_sampling == "flux_shift"
        ours = scheme.sample_sigmas(6, torch.Generator().manual_seed(7), latent_shape=(1, 32, h, w))
        u = torch.randn(6, generator=torch.Generator().manual_seed(7))
        torch.testing.assert_close(ours, _musubi_flux2_shift(u, h // 2, w // 2), rtol=1e-6, atol=0)
    zero = _musubi_flux2_shift(torch.zeros(1), h // 2, w // 2)
    assert math.isclose(float(zero), math.exp(mu) / (1 + math.exp(mu)), rel_tol=1e-6)
    expected_half = {1.15: 0.7595109, 0.7166666666666667: 0.6718726}[mu]
    assert math.isclose(float(zero), expected_half, rel_tol=0, abs_tol=1e-6)


def test_dev_lora_names_full_size_on_meta():
    """Golden counts on FLUX.2 [dev]'s full-size shapes (meta device): 8 double blocks x 8 + 48 single x 2 = 160 DiT
    modules in ComfyUI's names; Mistral-Small-3.1's 40 layers x 7 = 280 text-encoder modules."""
    from library.families.base import Components
    from library.families.flux2.configs import build_flux2_modules
    from library.families.common.mistral3 import language_model
    from networks.lora import create_network

    family = get_family("flux2")
    parts = build_flux2_modules("random:flux2_dev", device="meta")
    assert parts["transformer"].config.joint_attention_dim == 15360
    encoder = language_model(parts["text_encoder"])
    components = Components(denoiser=parts["transformer"], vae=None, text_encoders=[encoder],
                            tokenizers=[parts["tokenizer"]])
    network = create_network(1.0, 4, 4.0, None, components.text_encoders, components.denoiser,
                             lora_targets=family.lora_targets(components))
    names = {m.lora_name for m in network.unet_loras}
    assert len(names) == 160 and "lora_unet_single_blocks_47_linear1" in names \
        and "lora_unet_double_blocks_7_txt_attn_qkv" in names
    assert len(network.text_encoder_loras) == 280


@pytest.mark.parametrize("preset, version, expected", [
    ("tiny:flux2_dev", None, (50, 1.0, [4.0])),  # dev: Flux2Pipeline's 50 steps, guidance 4 (no CFG)
    ("tiny:flux2", None, (4, 1.0, None)),  # klein distilled: 4 steps, no guidance
    ("tiny:flux2", "klein-base-4b", (50, 4.0, None)),  # klein base: Flux2KleinPipeline's 50 steps, CFG 4
])
def test_sampling_defaults_follow_the_model(monkeypatch, preset, version, expected):
    """A request without steps / scale / guidance samples with the model's defaults (musubi-tuner's table of
    --model_version: dev 50 steps guidance 4.0, klein 4 and 1.0, klein base 50 and 4.0)."""
    from library.families.flux2 import generate as flux2_generate
    from library.sampling.generate import GenerationRequest

    seen = {}

    def fake_euler(latents, sigmas, velocity, scale, guided, **kwargs):
        seen.update(steps=len(sigmas) - 1, scale=scale)
        velocity(latents.repeat(2 if guided else 1, 1, 1, 1), 0.5)
        return latents

    calls = []
    family = get_family("flux2")
    original = family.predict
    monkeypatch.setattr(flux2_generate, "euler_sample", fake_euler)
    monkeypatch.setattr(type(family), "predict", lambda self, c, x, t, text, batch: calls.append(
        batch.get("guidance")) or original(c, x, t, text, batch))
    options = Flux2Options(model_version=version, qwen3_max_token_length=16, mistral3_max_token_length=TOKENS)
    components = family.load(LoadOptions(preset, family_options=options))
    family.generate(components, [GenerationRequest("a cat", width=32, height=32)])
    guidance = None if calls[0] is None else calls[0].tolist()
    assert (seen["steps"], seen["scale"], guidance) == expected


def test_convert_lora_to_diffusers_loads_in_flux2_pipeline_with_no_unexpected_keys(tmp_path, caplog):
    """tools/convert_lora.py --to diffusers on a dev LoRA (tiny:flux2_dev: 2 double, 3 single blocks): every key of
    the output is placed by Flux2Pipeline.load_lora_weights (no "unexpected" warning; 2 x 12 + 3 x 2 adapted
    Linears), and the pipeline's prediction equals the kohya file's in our network (measured 0.0; 1e-6 allowed)."""
    import logging

    from diffusers import Flux2Pipeline

    from library.core.safetensors_io import write_safetensors
    from library.families.flux2.loading import scheduler
    from tools.convert_lora import main as convert

    family = get_family("flux2")
    options = Flux2Options(mistral3_max_token_length=TOKENS)
    ours, theirs = (family.load(LoadOptions("tiny:flux2_dev", family_options=options)) for _ in range(2))
    full = random_lora_file(family, ours, str(tmp_path / "full.safetensors"))
    src = str(tmp_path / "kohya.safetensors")
    write_safetensors({k: v for k, v in load_file(full).items() if k.startswith("lora_unet_")}, src)
    dst = str(tmp_path / "diffusers.safetensors")
    assert convert(["--src_path", src, "--dst_path", dst, "--to", "diffusers"]) == 0
    pipe = Flux2Pipeline(scheduler=scheduler(), vae=theirs.vae, text_encoder=None, tokenizer=theirs.tokenizers[0],
                         transformer=theirs.denoiser)
    diffusers_logger = logging.getLogger("diffusers")  # it does not propagate: its handler is added for the test
    diffusers_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="diffusers"):
            pipe.load_lora_weights(load_file(dst))
    finally:
        diffusers_logger.removeHandler(caplog.handler)
    assert not diffusers_loading_warnings(caplog.records), caplog.text
    assert len([n for n, _ in theirs.denoiser.named_modules() if n.endswith(".lora_A")]) == 2 * 12 + 3 * 2
    network, _ = create_network_from_weights(1.0, src, ours.vae, ours.text_encoders, ours.denoiser,
                                             lora_targets=family.lora_targets(ours))
    network.apply_to(ours.text_encoders, ours.denoiser, apply_text_encoder=False, apply_unet=True)
    network.load_weights(src)
    text = family.encode_text(ours, family.tokenize(ours, ["a cat"], None), None)
    x = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = family.predict(ours, x, torch.tensor([400.0]), text, {})
        b = family.predict(theirs, x, torch.tensor([400.0]), text, {})
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
