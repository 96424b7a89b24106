"""FLUX.2 reference images (issue 25's edit training): control_directory images as extra tokens after the target's,
at time offsets 10, 20, ... (diffusers' Flux2Pipeline `image` input); 3 sampling steps with a reference equal the
pipeline's; a LoRA trains from a dataset with 2 controls per image; generation takes --control_image."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from library.families import get_family
from library.families.base import LoadOptions
from library.families.flux2 import family as flux2_family
from library.families.flux2.family import patchify, reference_tokens, unpatchify
from library.families.flux2.generate import flux2_sigmas
from library.families.flux2.loading import write_flux2_preset
from library.families.flux2.options import Flux2Options
from tests.test_edit_training import make_edit_dataset
from tests.train_helpers import assert_generation_follows_the_reference, dataset_config_args, make_trainer

TOKENS = 160  # room for the tiny tokenizer's 134-token system prompt and a caption


@pytest.fixture(scope="module")
def dev_files(tmp_path_factory):
    return write_flux2_preset("tiny:flux2_dev", str(tmp_path_factory.mktemp("flux2-dev-edit")))


def test_reference_tokens_are_the_pipelines_image_ids():
    """Two references of 4x4 and 2x3 patches: ids (10, row, column, 0) then (20, row, column, 0), as
    Flux2Pipeline._prepare_image_ids; tokens the packed 2x2 patches."""
    from diffusers import Flux2Pipeline

    a, b = torch.randn(2, 32, 8, 8), torch.randn(2, 32, 4, 6)
    tokens, ids = reference_tokens([a, b], "cpu", torch.float32)
    expected = Flux2Pipeline._prepare_image_ids([patchify(a[:1]), patchify(b[:1])])
    assert ids.shape == (2, 16 + 6, 4) and torch.equal(ids[0], expected[0]) and torch.equal(ids[1], expected[0])
    assert ids[0, 0].tolist() == [10, 0, 0, 0] and ids[0, 16].tolist() == [20, 0, 0, 0]
    torch.testing.assert_close(tokens[:, :16], Flux2Pipeline._pack_latents(patchify(a)), rtol=0, atol=0)


def test_sampling_with_a_reference_equals_flux2_pipeline(dev_files):
    """From the same noise and reference latents (the pipeline's preprocess + _encode_vae_image, the posterior's
    mode), 3 Euler steps of ours at guidance 4 end at Flux2Pipeline(image=...)'s latents (measured difference 0.0;
    1e-6 allowed: the σ schedule is computed by other code); without the reference they differ."""
    from diffusers import Flux2Pipeline

    family = get_family("flux2")
    c = family.load(LoadOptions(dev_files["diffusers"], family_options=Flux2Options(mistral3_max_token_length=TOKENS)))
    pipe = Flux2Pipeline.from_pretrained(dev_files["diffusers"])
    image = Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    text = family.encode_text(c, family.tokenize(c, ["make it red"], None), None)
    embeds = text.tensors["hidden_state"]
    noise = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = pipe(prompt_embeds=embeds, latents=patchify(noise), image=[image], height=64, width=64,
                      num_inference_steps=3, guidance_scale=4.0, output_type="latent", return_dict=False)[0]
        pixels = pipe.image_processor.preprocess(image, height=64, width=64, resize_mode="crop")
        reference = unpatchify(pipe._encode_vae_image(pixels, None))

        def run(controls):
            sigmas = flux2_sigmas(3, 16)
            latents = noise
            batch = {"guidance": torch.full((1,), 4.0)}
            if controls:
                batch["scaled_control_latents"] = controls
            for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
                v = family.predict(c, latents, torch.full((1,), sigma * 1000), text, batch)
                latents = latents + (sigma_next - sigma) * v
            return patchify(latents).reshape(1, 128, 16).permute(0, 2, 1)

        ours, plain = run([reference]), run([])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (plain - theirs).abs().max() > 1e-3


def _edit_args(toml: str, out: str, preset: str, extra=()) -> list[str]:
    return dataset_config_args(toml, out, preset, extra=["--network_module", "networks.lora_flux2", *extra])


def test_flux2_dev_trains_from_reference_images_and_generates_with_them(tmp_path, monkeypatch, dev_files):
    """flux2_train_network.py on tiny:flux2_dev with 2 control images per target (96x64, resized to the 64x64
    target's bucket, latents cached): every step passes both as references; tools/generate.py --control_image makes
    an image that the reference changes."""
    from safetensors import safe_open

    seen = []
    original = flux2_family.reference_tokens

    def spy(controls, device, dtype):
        seen.append([tuple(c.shape) for c in controls])
        return original(controls, device, dtype)

    monkeypatch.setattr(flux2_family, "reference_tokens", spy)
    toml = make_edit_dataset(str(tmp_path), controls=2)
    path = make_trainer(_edit_args(toml, str(tmp_path / "out"), "tiny:flux2_dev", extra=[
        "--mistral3_max_token_length", str(TOKENS), "--cache_latents", "--network_train_unet_only"]), "flux2").run()
    assert seen[:2] == [[(1, 32, 8, 8), (1, 32, 8, 8)]] * 2
    with safe_open(path, "pt") as f:
        assert f.get_tensor("lora_unet_double_blocks_1_txt_attn_qkv.lora_up.weight").abs().sum() > 0
    monkeypatch.setattr(flux2_family, "reference_tokens", original)
    reference, other = str(tmp_path / "control" / "img0_0.png"), str(tmp_path / "control" / "img1_0.png")
    assert_generation_follows_the_reference(tmp_path, ["--ckpt", dev_files["diffusers"]], "networks.lora_flux2", path,
                                            reference, other)
    assert os.path.isfile(path)
