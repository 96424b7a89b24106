"""Generation on the tiny SD model (every sampler, weighting, long prompts) and sampling during training."""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from library.families import get_family
from library.sampling.generate import (
    GenerationRequest,
    PromptOverrides,
    batches,
    generate_images,
    requests_from_prompts,
)
from library.sampling.output import (
    contact_sheet,
    grid_file_name,
    read_png_text,
    sample_file_name,
    save_samples,
)
from library.sampling.prompt_weighting import apply_token_weights, weighted_windows
from library.sampling.prompts import SamplePrompt
from library.sampling.samplers import sampler_names
from tests.train_helpers import base_args, make_dataset, make_trainer


@pytest.fixture
def sd1(tiny_sd1):
    return get_family("sd"), tiny_sd1


def request(sampler="ddim", seed=1, prompt="a red cat", **kw):
    return GenerationRequest(prompt, "blurry", seed=seed, width=64, height=64, steps=2, scale=5.0, sampler=sampler,
                             **kw)


def pixels(generated):
    return np.stack([np.asarray(g.image) for g in generated])


def test_every_sampler_runs_and_is_seeded(sd1):
    family, c = sd1
    samplers = [n for n in sampler_names("ddpm") if not n.startswith("k_")]  # k_* are aliases of these
    out = generate_images(family, c, [request(s) for s in samplers])
    assert [g.request.sampler for g in out] == samplers
    images = pixels(out)
    assert images.shape == (len(samplers), 64, 64, 3) and images.dtype == np.uint8
    assert all(img.std() > 0 for img in images)
    by_name = dict(zip(samplers, images))
    assert not np.array_equal(by_name["euler"], by_name["euler_a"])
    # the same seed gives the same image; another seed another image
    again = pixels(generate_images(family, c, [request("k_euler_a"), request("euler_a", seed=2)]))
    assert np.array_equal(again[0], by_name["euler_a"]) and not np.array_equal(again[0], again[1])


def test_batching_does_not_change_images(sd1):
    family, c = sd1
    reqs = [request("euler_a", seed=s, prompt=p) for s, p in ((1, "a cat"), (2, "a dog, (long tail:1.3)"))]
    one_by_one = pixels(generate_images(family, c, reqs, batch_size=1))
    together = pixels(generate_images(family, c, reqs, batch_size=2))
    assert np.abs(one_by_one.astype(int) - together.astype(int)).max() <= 1  # float sums in another order
    assert not np.array_equal(one_by_one[0], one_by_one[1])


def test_defaults_are_filled_in(sd1):
    family, c = sd1
    r = GenerationRequest("a cat", seed=3, width=70, height=64, steps=1)
    (g,) = generate_images(family, c, [r])
    assert (g.request.width, g.request.height, g.request.steps, g.request.scale, g.request.sampler) == \
        (64, 64, 1, 7.5, "ddim")
    assert g.image.size == (64, 64)


def test_unweighted_prompt_encodes_as_training_does(sd1):
    family, c = sd1
    from library.families.sd.generate import encode_prompts

    short = "a photo of a cat"
    long = ", ".join(["red cat on a blue table"] * 14)  # > 75 tokens: two windows
    for text, max_len, n_states in ((short, None, 77), (long, 150, 152)):
        ref = family.encode_text(c, family.tokenize(c, [text], max_len), None).tensors["encoder_hidden_states"]
        ours = encode_prompts(c, [text], None, torch.device("cpu"))
        assert ours.shape == (1, n_states, 32)
        assert torch.equal(ours, ref)
    ids, _ = weighted_windows(c.tokenizers[0], [long], 2)
    assert torch.equal(ids, family.tokenize(c, [long], 150)[0])


def test_weights_scale_tokens_and_keep_the_mean(sd1):
    family, c = sd1
    tok = c.tokenizers[0]
    ids, weights = weighted_windows(tok, ["a (red:1.5) cat"], 1)
    plain, _ = weighted_windows(tok, ["a red cat"], 1)
    assert torch.equal(ids, plain)
    n_red = len(tok("red", add_special_tokens=False).input_ids)
    assert weights[0, :2 + n_red + 2].tolist() == [1.0, 1.0] + [1.5] * n_red + [1.0, 1.0]
    states = torch.randn(1, 77, 8) + 1.0
    out = apply_token_weights(states, weights)
    assert out.mean().item() == pytest.approx(states.mean().item(), rel=1e-5)
    ratio = (out / states)[0, :, 0]
    assert ratio[2].item() == pytest.approx(1.5 * ratio[0].item(), rel=1e-5)
    # zero-mean states (the tiny CLIP's final norm has no bias): weights apply, no NaN from 0/0
    centred = states - states.mean(dim=-1, keepdim=True)
    out = apply_token_weights(centred, weights)
    assert torch.isfinite(out).all() and torch.allclose(out[0, 2], centred[0, 2] * 1.5)


def test_requests_seeds_and_overrides():
    prompts = [SamplePrompt("a", seed=10, index=0), SamplePrompt("b", width=128, sampler="k_euler", index=1)]
    reqs = requests_from_prompts(prompts, images_per_prompt=2, seed=100,
                                 overrides=PromptOverrides(width=64, steps=4, sampler="ddim"), number_images=True)
    assert [(r.prompt, r.seed, r.seed_given, r.index, r.width, r.steps, r.sampler) for r in reqs] == [
        ("a", 10, True, 0, 64, 4, "ddim"), ("a", 11, True, 1, 64, 4, "ddim"),
        ("b", 102, True, 2, 128, 4, "euler"), ("b", 103, True, 3, 128, 4, "euler")]
    unseeded = requests_from_prompts(prompts[1:], images_per_prompt=2)
    assert [(r.index, r.seed_given) for r in unseeded] == [(1, False), (1, False)]
    assert [len(b) for b in batches(reqs, 3)] == [2, 2]  # different width: a new batch


def test_output_names_metadata_and_grid(tmp_path, sd1):
    assert sample_file_name("lora", "e000003", 1, "20240101120000", 42) == "lora_e000003_01_20240101120000_42.png"
    assert sample_file_name("lora", "000500", 0, "20240101120000") == "lora_000500_00_20240101120000.png"
    assert sample_file_name(None, "000500", 12, "20240101120000") == "000500_12_20240101120000.png"
    assert sample_file_name("im", None, 3, "20240101120000", 7) == "im_03_20240101120000_7.png"
    assert grid_file_name("lora", "e000003") == "lora_e000003_grid.png"

    family, c = sd1
    generated = generate_images(family, c, [request(seed=5, index=0, seed_given=True), request(seed=6, index=1)])
    paths = save_samples(generated, str(tmp_path), "lora", "000010", extra={"step": 10, "epoch": 2})
    names = [os.path.basename(p) for p in paths]
    assert [re.sub(r"_\d{14}", "_<ts>", n) for n in names] == \
        ["lora_000010_00_<ts>_5.png", "lora_000010_01_<ts>.png", "lora_000010_grid.png"]
    meta = read_png_text(paths[0])
    assert {k: meta[k] for k in ("prompt", "negative_prompt", "seed", "steps", "scale", "sampler", "width",
                                 "height", "step", "epoch")} == {
        "prompt": "a red cat", "negative_prompt": "blurry", "seed": "5", "steps": "2", "scale": "5.0",
        "sampler": "ddim", "width": "64", "height": "64", "step": "10", "epoch": "2"}
    assert meta["parameters"] == ("a red cat\nNegative prompt: blurry\nSteps: 2, Sampler: ddim, CFG scale: 5.0, "
                                  "Seed: 5, Size: 64x64")
    assert not glob.glob(str(tmp_path / ".*"))  # no temporary files left
    from PIL import Image

    with Image.open(paths[2]) as grid:
        assert grid.size == (128, 64 + 14)
    assert contact_sheet([g.image for g in generated] * 3).size == (128 * 3 // 2, 128)


def _train(tmp_path, name, extra):
    data = make_dataset(str(tmp_path / name), n=2)
    out = str(tmp_path / name / "out")
    trainer = make_trainer(base_args(data, out, steps=4, extra=extra))
    path = trainer.run()
    return trainer, load_file(path), out


def test_sampling_during_training_keeps_the_trajectory(tmp_path):
    """Files and TensorBoard images appear, and the trained LoRA is bitwise the one trained without sampling."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 2 --d 5\n(sks toy:1.2) --w 64 --h 64 --s 2 --ss euler_a\n")
    logs = str(tmp_path / "logs")
    # 2 images x 5 repeats = 10 steps an epoch; 4 steps end the run inside epoch 1
    sampled, weights_sampled, out = _train(tmp_path, "with", [
        "--sample_prompts", str(prompts), "--sample_every_n_steps", "2", "--sample_every_n_epochs", "1",
        "--sample_at_first", "--network_dropout", "0.1", "--log_with", "tensorboard", "--logging_dir", logs])
    _, weights_plain, _ = _train(tmp_path, "without", ["--network_dropout", "0.1"])

    assert weights_sampled.keys() == weights_plain.keys()
    assert all(torch.equal(weights_sampled[k], weights_plain[k]) for k in weights_plain)

    names = sorted(re.sub(r"_\d{14}", "_<ts>", os.path.basename(p))
                   for p in glob.glob(os.path.join(out, "sample", "*.png")))
    assert names == sorted([
        "lora_e000000_00_<ts>_5.png", "lora_e000000_01_<ts>.png", "lora_e000000_grid.png",
        "lora_000002_00_<ts>_5.png", "lora_000002_01_<ts>.png", "lora_000002_grid.png",
        "lora_000004_00_<ts>_5.png", "lora_000004_01_<ts>.png", "lora_000004_grid.png",
    ])  # the end of the (cut-short) epoch 1 is step 4, already sampled: not twice
    first = sorted(glob.glob(os.path.join(out, "sample", "lora_000002_00_*.png")))[0]
    assert read_png_text(first)["step"] == "2" and read_png_text(first)["sampler"] == "ddim"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_dir,) = {os.path.dirname(p) for p in glob.glob(os.path.join(logs, "*", "*", "events.*"))}
    acc = EventAccumulator(event_dir, size_guidance={"images": 0})
    acc.Reload()
    assert sorted(acc.Tags()["images"]) == ["sample/00", "sample/01"]
    assert [e.step for e in acc.Images("sample/00")] == [0, 2, 4]
    assert (acc.Images("sample/01")[0].width, acc.Images("sample/01")[0].height) == (64, 64)
