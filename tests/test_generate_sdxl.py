"""SDXL generation on the tiny model: samplers, seeds, prompt encoding, size ids, LoRAs, sampling in training."""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from library.sampling.generate import GenerationRequest, generate_images
from library.sampling.output import read_png_text
from library.train.adapters.network_apply import NetworkSpec
from tests.train_helpers import base_args, make_dataset, make_trainer
from tools import generate as tool

ARGS = ["--W", "64", "--H", "64", "--steps", "2", "--scale", "4", "--sampler", "euler_a"]


def options(outdir, prompt="a red cat --n blurry", **kw):
    args = tool.build_parser().parse_args(["--ckpt", "tiny:sdxl", "--sdxl", "--outdir", str(outdir),
                                           "--prompt", prompt, "--device", "cpu", *ARGS])
    o = tool.options_from_args(args)
    for key, value in kw.items():
        setattr(o, key, value)
    return o


@pytest.fixture(scope="module")
def loaded():
    """(family, components, device) as tools/generate.py loads them for --sdxl."""
    return tool.load_model(options("unused"))


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory, loaded):
    """A LoRA on both text encoders and the UNet with random (non-zero) up weights."""
    from tests.train_helpers import random_lora_file

    family, c, _ = loaded
    return random_lora_file(family, c, str(tmp_path_factory.mktemp("lora") / "toy_xl.safetensors"))


def request(sampler="ddim", seed=1, prompt="a red cat", width=64, height=64, **kw):
    return GenerationRequest(prompt, "blurry", seed=seed, width=width, height=height, steps=2, scale=5.0,
                             sampler=sampler, **kw)


def pixels(generated):
    return np.stack([np.asarray(g.image) for g in generated])


def images(paths):
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sorted(paths)])


def test_two_samplers_run_and_the_seed_fixes_the_image(loaded):
    family, c, _ = loaded
    out = generate_images(family, c, [request("ddim"), request("euler_a", height=96)])
    assert [(g.request.sampler, g.image.size) for g in out] == [("ddim", (64, 64)), ("euler_a", (64, 96))]
    assert all(np.asarray(g.image).std() > 0 for g in out)
    again = generate_images(family, c, [request("euler_a", height=96), request("euler_a", seed=2, height=96)])
    assert np.array_equal(np.asarray(again[0].image), np.asarray(out[1].image))
    assert not np.array_equal(np.asarray(again[0].image), np.asarray(again[1].image))


def test_defaults_are_sdxl_ones():
    from library.families.sdxl.generate import resolve_sdxl_request

    r = resolve_sdxl_request(GenerationRequest("a cat"))
    assert (r.width, r.height, r.steps, r.scale, r.sampler) == (1024, 1024, 30, 7.5, "ddim")
    r = resolve_sdxl_request(GenerationRequest("a cat", width=70, height=100, scale=1.0))
    assert (r.width, r.height, r.scale) == (64, 96, 1.0)


def test_size_ids_are_the_requested_size_uncropped():
    from library.families.sdxl.family import time_ids
    from library.families.sdxl.generate import size_ids

    ids = time_ids(size_ids(2, 96, 64), torch.device("cpu"), torch.float32)
    assert ids.tolist() == [[96.0, 64.0, 0.0, 0.0, 96.0, 64.0]] * 2


def test_unweighted_prompts_encode_as_training_does(loaded):
    from library.families.sdxl.generate import encode_prompts_sdxl

    family, c, device = loaded
    long = ", ".join(["red cat on a blue table"] * 14)  # > 75 tokens: two windows
    for text, max_len, n_states in (("a photo of a cat", None, 77), (long, 150, 152)):
        ref = family.encode_text(c, family.tokenize(c, [text], max_len), None).tensors
        ours = encode_prompts_sdxl(c, [text], device)
        assert {k: tuple(v.shape) for k, v in ours.items()} == {
            "hidden_state1": (1, n_states, 32), "hidden_state2": (1, n_states, 64), "pool2": (1, 64)}
        assert all(torch.equal(ours[k], ref[k]) for k in ref)
    # weighting changes both encoders' states and leaves the pooled embedding alone
    plain, weighted = (encode_prompts_sdxl(c, [t], device) for t in ("a red cat", "a (red:1.5) cat"))
    assert torch.equal(plain["pool2"], weighted["pool2"])
    assert not torch.equal(plain["hidden_state1"], weighted["hidden_state1"])
    assert not torch.equal(plain["hidden_state2"], weighted["hidden_state2"])


def test_batching_does_not_change_images(loaded):
    family, c, _ = loaded
    reqs = [request("euler_a", seed=s, prompt=p) for s, p in ((1, "a cat"), (2, "a dog, (long tail:1.3)"))]
    one_by_one = pixels(generate_images(family, c, reqs, batch_size=1))
    together = pixels(generate_images(family, c, reqs, batch_size=2))
    assert np.abs(one_by_one.astype(int) - together.astype(int)).max() <= 1  # float sums in another order


def test_tool_with_lora_at_multiplier_zero_equals_the_base(tmp_path, loaded, lora_file):
    assert options("x").family == "sdxl"
    base = tool.run(options(tmp_path / "base", seed=1), loaded)
    zero = tool.run(options(tmp_path / "zero", seed=1, networks=[NetworkSpec("networks.lora", lora_file, 0.0)]),
                    loaded)
    full = tool.run(options(tmp_path / "full", seed=1, networks=[NetworkSpec("networks.lora", lora_file, 1.0)]),
                    loaded)
    assert [re.sub(r"_\d{14}", "_<ts>", os.path.basename(p)) for p in base] == ["im_00_<ts>_1.png"]
    assert np.array_equal(images(base), images(zero))
    assert not np.array_equal(images(base), images(full))
    meta = read_png_text(full[0])
    assert {k: meta[k] for k in ("prompt", "seed", "steps", "scale", "sampler", "width", "height", "model",
                                 "networks")} == {
        "prompt": "a red cat", "seed": "1", "steps": "2", "scale": "4.0", "sampler": "euler_a", "width": "64",
        "height": "64", "model": "tiny:sdxl", "networks": "toy_xl.safetensors:1.0"}


def _train(tmp_path, name, extra):
    data = make_dataset(str(tmp_path / name), n=1)
    out = str(tmp_path / name / "out")
    trainer = make_trainer(base_args(data, out, preset="tiny:sdxl", steps=2, extra=extra), "sdxl")
    return load_file(trainer.run()), out


def test_sampling_during_sdxl_training_keeps_the_trajectory(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 2 --d 5\n(sks toy:1.2) --w 64 --h 96 --s 2 --ss euler_a\n")
    sampled, out = _train(tmp_path, "with", ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
                                             "--sample_at_first", "--network_dropout", "0.1"])
    plain, _ = _train(tmp_path, "without", ["--network_dropout", "0.1"])
    assert sampled.keys() == plain.keys()
    assert all(torch.equal(sampled[k], plain[k]) for k in plain)

    names = sorted(re.sub(r"_\d{14}", "_<ts>", os.path.basename(p))
                   for p in glob.glob(os.path.join(out, "sample", "*.png")))
    assert names == sorted([
        "lora_e000000_00_<ts>_5.png", "lora_e000000_01_<ts>.png", "lora_e000000_grid.png",
        "lora_000002_00_<ts>_5.png", "lora_000002_01_<ts>.png", "lora_000002_grid.png",
    ])
    second = sorted(glob.glob(os.path.join(out, "sample", "lora_000002_01_*.png")))[0]
    meta = read_png_text(second)
    assert (meta["step"], meta["sampler"], meta["width"], meta["height"]) == ("2", "euler_a", "64", "96")
    with Image.open(second) as img:
        assert img.size == (64, 96)


def test_sampling_with_cached_text_encoder_outputs_encodes_new_prompts(tmp_path):
    """sd-scripts crashes when sample prompts are not in the text-encoder cache; here the encoders
    are borrowed for the prompts, and training still runs entirely from the cache."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt that no training caption has --w 64 --h 64 --s 2 --d 3\n")
    cache = ["--cache_text_encoder_outputs", "--network_train_unet_only"]
    sampled, out = _train(tmp_path, "with", cache + ["--sample_prompts", str(prompts), "--sample_every_n_steps", "1"])
    plain, _ = _train(tmp_path, "without", cache)
    assert all(torch.equal(sampled[k], plain[k]) for k in plain)
    names = sorted(re.sub(r"_\d{14}", "_<ts>", os.path.basename(p))
                   for p in glob.glob(os.path.join(out, "sample", "*.png")))
    assert names == ["lora_000001_00_<ts>_3.png", "lora_000001_grid.png",
                     "lora_000002_00_<ts>_3.png", "lora_000002_grid.png"]
