"""Chroma generation on the tiny model: tools/generate.py against a hand-run Euler loop over the transformer, the
defaults (guidance 0, CFG only when --l is not 1), and sampling during a tiny Chroma LoRA run."""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from library.cli.entry import run_training
from library.families.chroma.generate import resolve_chroma_request
from library.families.chroma.model import chroma_to_single_file
from library.families.detect import detect_family
from library.sampling.generate import GenerationRequest, generate_images
from library.sampling.output import read_png_text
from tests.train_helpers import base_args, make_dataset
from tools import generate as tool


@pytest.fixture(scope="module")
def chroma_file(tmp_path_factory, tiny_flux_files):
    """tiny:chroma's transformer as a Chroma single file, with tiny:flux's T5 and AE files (tiny:chroma's are the
    same weights); loaded once through tools/generate.py's own loader."""
    from library.families import get_family
    from library.families.base import LoadOptions

    c = get_family("chroma").load(LoadOptions("tiny:chroma"))
    path = str(tmp_path_factory.mktemp("chroma") / "chroma-tiny.safetensors")
    save_file({k: v.contiguous() for k, v in chroma_to_single_file(c.denoiser.state_dict()).items()}, path)
    argv = ["--ckpt", path, "--flux", "--t5xxl", tiny_flux_files["t5xxl"], "--ae", tiny_flux_files["ae"],
            "--device", "cpu"]
    return argv, tool.load_model(tool.options_from_args(tool.build_parser().parse_args(
        argv + ["--outdir", "unused", "--prompt", "x"])))


def hand_run(c, prompt: str, negative: str, seed: int, steps: int, scale: float, size: int = 64) -> np.ndarray:
    """The image sd-scripts' Chroma sampling makes, written out over the diffusers transformer: T5 states with the
    mask (+1 padding token), FLUX.1's shifted σ, Euler steps on uncond + scale·(cond − uncond), AE decode."""
    transformer, t5, tokenizer, vae = c.denoiser, c.text_encoders[0], c.tokenizers[0], c.vae

    def encode(text):
        t = tokenizer([text], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
        states = t5(t.input_ids, attention_mask=t.attention_mask).last_hidden_state
        keep = torch.arange(512) <= t.attention_mask.sum()  # the caption and one padding token
        return states, keep

    n = size // 16  # packed patches per side
    noise = torch.randn((16, size // 8, size // 8), generator=torch.Generator("cpu").manual_seed(seed))
    x = noise.reshape(16, n, 2, n, 2).permute(1, 3, 0, 2, 4).reshape(1, n * n, 64)
    img_ids = torch.tensor([[0.0, i, j] for i in range(n) for j in range(n)])
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (n * n - 256)
    sigmas = [0.0 if t == 0 else math.exp(mu) / (math.exp(mu) + (1 / t - 1)) for t in np.linspace(1, 0, steps + 1)]
    conds = [encode(prompt), encode(negative)]
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            v_cond, v_uncond = (transformer(hidden_states=x, encoder_hidden_states=states,
                                            timestep=torch.tensor([sigma], dtype=torch.float32), img_ids=img_ids,
                                            txt_ids=torch.zeros(512, 3), attention_mask=torch.cat(
                                                [keep, torch.ones(n * n, dtype=torch.bool)])[None]).sample
                                for states, keep in conds)
            x = x + (sigma_next - sigma) * (v_uncond + scale * (v_cond - v_uncond))
        latents = x.reshape(n, n, 16, 2, 2).permute(2, 0, 3, 1, 4).reshape(1, 16, size // 8, size // 8)
        pixels = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
    return (((pixels[0] + 1) / 2).clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def test_tool_image_equals_a_hand_run_euler_loop(tmp_path, chroma_file):
    argv, loaded = chroma_file
    args = tool.build_parser().parse_args(argv + ["--outdir", str(tmp_path), "--prompt",
                                                  "a red cat --n blurry --l 4 --d 3", "--W", "64", "--H", "64",
                                                  "--steps", "2"])
    o = tool.options_from_args(args)
    assert o.family == "chroma"  # --flux with a Chroma file: Chroma, as sd-scripts' --model_type chroma
    (path,) = tool.run(o, loaded)
    got = np.asarray(Image.open(path).convert("RGB"))
    want = hand_run(loaded[1], "a red cat", "blurry", seed=3, steps=2, scale=4.0)
    assert got.shape == (64, 64, 3) and got.std() > 0
    # Cond and uncond run as one batch in the tool and one by one here: a rounding step at most.
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    meta = read_png_text(path)
    assert {k: meta[k] for k in ("prompt", "negative_prompt", "seed", "steps", "scale", "guidance", "sampler")} == {
        "prompt": "a red cat", "negative_prompt": "blurry", "seed": "3", "steps": "2", "scale": "4.0",
        "guidance": "0.0", "sampler": "flow_euler"}


def test_detects_chroma_presets_and_files(chroma_file):
    argv, _ = chroma_file
    assert detect_family("tiny:chroma") == "chroma" and detect_family("random:chroma") == "chroma"
    assert detect_family(argv[1]) == "chroma"


def test_defaults_guidance_and_cfg(chroma_file, caplog):
    from library.core import errors

    _, (family, c, _) = chroma_file
    c = dataclasses.replace(c, options=dataclasses.replace(c.options, t5xxl_max_token_length=16))  # faster T5
    r = resolve_chroma_request(GenerationRequest("a cat", seed=1, width=70))
    assert (r.width, r.height, r.steps, r.scale, r.guidance, r.sampler) == (64, 512, 20, 1.0, 0.0, "flow_euler")
    errors.forget_warnings()  # the warning is logged once per process
    with caplog.at_level(logging.WARNING):
        assert resolve_chroma_request(GenerationRequest("a cat", guidance=3.5)).guidance == 0.0
    assert "guidance 3.5 (--g) is ignored for Chroma: the model has no guidance input" in caplog.text

    def image(**kw):
        request = GenerationRequest("a red cat", kw.pop("negative_prompt", ""), seed=5, width=64, height=64,
                                    steps=1, **kw)
        return np.asarray(generate_images(family, c, [request])[0].image)

    plain, other_negative, cfg, with_g = (image(negative_prompt="blurry"), image(negative_prompt="a dog"),
                                          image(negative_prompt="a dog", scale=3.0), image(guidance=2.0))
    assert np.array_equal(plain, other_negative)  # scale 1: no negative pass
    assert not np.array_equal(plain, cfg)
    assert np.array_equal(plain, with_g)  # no guidance input: --g changes nothing
    # captions of different lengths (each row its own mask) with their negatives: batched as one by one
    requests = [GenerationRequest("a cat", "blurry", seed=1, width=64, height=64, steps=1, scale=3.0),
                GenerationRequest("a dog with a long tail and a red hat", "", seed=2, width=64, height=64, steps=1,
                                  scale=3.0)]
    one_by_one, together = (np.stack([np.asarray(g.image) for g in generate_images(family, c, requests, batch_size=n)])
                            for n in (1, 2))
    assert np.abs(one_by_one.astype(int) - together.astype(int)).max() <= 1


def test_sampling_during_chroma_training_writes_images(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 64 --s 2 --d 5\nsks toy --w 64 --h 64 --s 1 --l 4 --n dark --g 3\n")
    data = make_dataset(str(tmp_path / "data"), n=2)
    out = str(tmp_path / "out")
    argv = base_args(data, out, preset="tiny:chroma", steps=1, extra=[
        "--model_type", "chroma", "--apply_t5_attn_mask", "--guidance_scale", "0", "--t5xxl_max_token_length", "8",
        "--network_module", "networks.lora_flux", "--sample_prompts", str(prompts), "--sample_every_n_steps", "1",
        "--sample_at_first"])
    assert run_training("flux", "test", argv) == 0
    names = sorted(re.sub(r"_\d{14}", "_<ts>", os.path.basename(p)) for p in glob.glob(os.path.join(out, "sample", "*")))
    assert names == sorted(["lora_e000000_00_<ts>_5.png", "lora_e000000_01_<ts>.png", "lora_e000000_grid.png",
                            "lora_000001_00_<ts>_5.png", "lora_000001_01_<ts>.png", "lora_000001_grid.png"])
    meta = read_png_text(glob.glob(os.path.join(out, "sample", "lora_000001_01_*.png"))[0])
    assert {k: meta[k] for k in ("steps", "scale", "guidance", "sampler", "negative_prompt", "step")} == {
        "steps": "1", "scale": "4.0", "guidance": "0.0", "sampler": "flow_euler", "negative_prompt": "dark",
        "step": "1"}
    image = np.asarray(Image.open(glob.glob(os.path.join(out, "sample", "lora_000001_00_*.png"))[0]))
    assert image.shape == (64, 64, 3) and image.std() > 0
