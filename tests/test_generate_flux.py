"""FLUX.1 generation on the tiny model: the flow-match Euler loop, defaults, CFG and guidance, LoRAs, the tool,
and sampling during a tiny Flux training run."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from library.families.flux.generate import flux_sigmas

from library.families.common.flow_sampling import decode_images, encode_prompts_flux
from library.sampling.generate import GenerationRequest, generate_images
from library.sampling.output import read_png_text
from library.train.adapters.network_apply import NetworkSpec
from tests.train_helpers import base_args, make_dataset, make_trainer
from tools import generate as tool


@pytest.fixture(scope="module")
def loaded():
    family, c, device = tool.load_model(tool.GenerateOptions(ckpt="tiny:flux", outdir="unused", family="flux",
                                                             device="cpu"))
    # 16 T5 tokens instead of dev's 512 keep the tests fast; the loop does not depend on it.
    c.options = dataclasses.replace(family.options(c), t5xxl_max_token_length=16)
    return family, c, device


def request(seed=1, prompt="a red cat", **kw):
    return GenerationRequest(prompt, kw.pop("negative_prompt", ""), seed=seed, width=64, height=64,
                             steps=kw.pop("steps", 2), **kw)


def pixels(generated):
    return np.stack([np.asarray(g.image) for g in generated])


def test_sigmas_match_diffusers_flux_schedule():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from library.objectives.flow import flux_shift_mu

    ours = flux_sigmas(4, 16, shift=True)
    # μ(16 tokens) = 0.5 + 0.65 · (16 - 256) / 3840
    assert flux_shift_mu(16) == pytest.approx(0.459375)
    assert ours.tolist() == pytest.approx([1.0, 0.82606, 0.61287, 0.34542, 0.0], abs=1e-5)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=flux_shift_mu(16))  # what FluxPipeline does
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=0, atol=1e-6)
    assert flux_sigmas(4, 16, shift=False).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]  # schnell


def test_defaults_and_same_seed_same_image(loaded):
    family, c, _ = loaded
    out = generate_images(family, c, [GenerationRequest("a cat", seed=3, width=70, height=64, steps=2)])
    r = out[0].request
    assert (r.width, r.height, r.steps, r.scale, r.guidance, r.sampler) == (64, 64, 2, 1.0, 3.5, "flow_euler")
    assert out[0].image.size == (64, 64)
    images = pixels(generate_images(family, c, [request(seed=1), request(seed=1), request(seed=2)]))
    assert images.shape == (3, 64, 64, 3) and images.dtype == np.uint8 and images[0].std() > 0
    assert np.array_equal(images[0], images[1]) and not np.array_equal(images[0], images[2])


def test_one_step_is_one_euler_step_from_noise(loaded):
    """steps=1: x0 = ε + (0 - 1)·v(ε, σ=1), decoded through the AE's shift and scale."""
    family, c, _ = loaded
    (g,) = generate_images(family, c, [request(seed=7, steps=1)])
    noise = torch.randn((16, 8, 8), generator=torch.Generator("cpu").manual_seed(7))[None]
    text = encode_prompts_flux(family, c, ["a red cat"], torch.device("cpu"))
    with torch.no_grad():
        v = family.predict(c, noise, torch.tensor([1000.0]), text, {"guidance": torch.tensor([3.5])})
        expected = decode_images(family, c.vae, noise - v)
    assert np.array_equal(np.asarray(g.image), expected[0])


def test_cfg_guidance_and_batching(loaded):
    family, c, _ = loaded
    base, other_negative, cfg, low_guidance = pixels(generate_images(family, c, [
        request(negative_prompt="blurry"), request(negative_prompt="a dog"),
        request(negative_prompt="a dog", scale=3.0), request(guidance=1.0)]))
    assert np.array_equal(base, other_negative)  # scale 1: no negative pass at all
    assert not np.array_equal(base, cfg)
    assert not np.array_equal(base, low_guidance)  # the dev model's guidance embedding is fed --g
    reqs = [request(seed=1, prompt="a cat"), request(seed=2, prompt="a dog, long tail")]
    one_by_one = pixels(generate_images(family, c, reqs, batch_size=1))
    together = pixels(generate_images(family, c, reqs, batch_size=2))
    assert np.abs(one_by_one.astype(int) - together.astype(int)).max() <= 1


def test_ddpm_sampler_falls_back_to_flow_euler(loaded, caplog):
    family, c, _ = loaded
    from library.core import errors

    errors.forget_warnings()  # the warning is logged once per process
    with caplog.at_level(logging.WARNING):
        a, b = generate_images(family, c, [request(sampler="euler_a"), request()])
    assert a.request.sampler == "flow_euler" and np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert "sampler 'euler_a' does not apply to FLUX.1 (a flow model); using flow_euler" in caplog.text


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory, loaded):
    from tests.train_helpers import random_lora_file

    family, c, _ = loaded
    return random_lora_file(family, c, str(tmp_path_factory.mktemp("lora") / "toy_flux.safetensors"))


def options(outdir, **kw):
    args = tool.build_parser().parse_args(["--ckpt", "tiny:flux", "--flux", "--outdir", str(outdir), "--prompt",
                                           "a red cat --g 4", "--device", "cpu", "--W", "64", "--H", "64",
                                           "--steps", "2", "--seed", "1"])
    return dataclasses.replace(tool.options_from_args(args), **kw)


def images(paths):
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sorted(paths)])


def test_tool_lora_at_multiplier_zero_equals_the_base(tmp_path, loaded, lora_file):
    base_paths = tool.run(options(tmp_path / "base"), loaded)
    zero = tool.run(options(tmp_path / "zero", networks=[NetworkSpec("networks.lora", lora_file, 0.0)]), loaded)
    full = tool.run(options(tmp_path / "full", networks=[NetworkSpec("networks.lora", lora_file, 1.0)]), loaded)
    base = images(base_paths)
    assert np.array_equal(base, images(zero)) and not np.array_equal(base, images(full))
    assert np.array_equal(base, images(tool.run(options(tmp_path / "again"), loaded)))  # networks removed
    assert [re.sub(r"_\d{14}", "_<ts>", os.path.basename(p)) for p in base_paths] == ["im_00_<ts>_1.png"]
    meta = read_png_text(base_paths[0])
    assert {k: meta[k] for k in ("prompt", "seed", "steps", "scale", "guidance", "sampler", "width", "model")} == {
        "prompt": "a red cat", "seed": "1", "steps": "2", "scale": "1.0", "guidance": "4.0",
        "sampler": "flow_euler", "width": "64", "model": "tiny:flux"}


def test_tool_accepts_flux_flags(tmp_path):
    args = tool.build_parser().parse_args(["--ckpt", "tiny:flux", "--flux", "--outdir", str(tmp_path),
                                           "--prompt", "a cat", "--guidance", "2.5"])
    o = tool.options_from_args(args)
    assert (o.family, o.overrides.guidance) == ("flux", 2.5)
    from library.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--guidance: expected a number >= 0, got -1.0$"):
        tool.options_from_args(tool.build_parser().parse_args(
            ["--ckpt", "tiny:flux", "--flux", "--outdir", str(tmp_path), "--prompt", "a cat", "--guidance", "-1"]))


def _train(tmp_path, name, extra):
    data = make_dataset(str(tmp_path / name), n=2)
    out = str(tmp_path / name / "out")
    trainer = make_trainer(base_args(data, out, "tiny:flux", steps=2, extra=[
        "--t5xxl_max_token_length", "16", "--network_train_unet_only", "--timestep_sampling", "shift",
        "--guidance_scale", "1.0", *extra]), family_name="flux")
    path = trainer.run()
    return load_file(path), out


def test_sampling_during_flux_training_keeps_the_trajectory(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 2 --d 5 --g 3\nsks toy --w 64 --h 64 --s 1 --l 2 --n dark\n")
    sampled, out = _train(tmp_path, "with", ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
                                             "--sample_at_first"])
    plain, _ = _train(tmp_path, "without", [])
    assert sampled.keys() == plain.keys()
    assert all(torch.equal(sampled[k], plain[k]) for k in plain)
    names = sorted(re.sub(r"_\d{14}", "_<ts>", os.path.basename(p))
                   for p in glob.glob(os.path.join(out, "sample", "*.png")))
    assert names == sorted(["lora_e000000_00_<ts>_5.png", "lora_e000000_01_<ts>.png", "lora_e000000_grid.png",
                            "lora_000002_00_<ts>_5.png", "lora_000002_01_<ts>.png", "lora_000002_grid.png"])
    meta = read_png_text(glob.glob(os.path.join(out, "sample", "lora_000002_01_*.png"))[0])
    assert {k: meta[k] for k in ("steps", "scale", "guidance", "sampler", "negative_prompt", "step")} == {
        "steps": "1", "scale": "2.0", "guidance": "3.5", "sampler": "flow_euler", "negative_prompt": "dark",
        "step": "2"}
