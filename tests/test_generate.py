"""tools/generate.py on the tiny SD model: files and metadata, LoRA multipliers, --merge, flag errors."""

from __future__ import annotations

import copy
import glob
import os
import re

import numpy as np
import pytest
from PIL import Image

from library.core.errors import ConfigError
from library.sampling.output import read_png_text
from library.train.adapters.network_apply import NetworkSpec, network_specs
from tools import generate as tool

ARGS = ["--W", "64", "--H", "64", "--steps", "2", "--scale", "4", "--sampler", "euler_a"]


@pytest.fixture(scope="module")
def loaded():
    o = tool.GenerateOptions(ckpt="tiny:sd1", outdir="unused", device="cpu")
    return tool.load_model(o)


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory, loaded):
    """A LoRA on the text encoder and UNet with random (non-zero) up weights."""
    from tests.train_helpers import random_lora_file

    family, c, _ = loaded
    return random_lora_file(family, c, str(tmp_path_factory.mktemp("lora") / "toy.safetensors"))


def options(outdir, prompt="a red cat --n blurry", **kw):
    args = tool.build_parser().parse_args(["--ckpt", "tiny:sd1", "--outdir", str(outdir), "--prompt", prompt,
                                           "--device", "cpu", *ARGS])
    o = tool.options_from_args(args)
    for key, value in kw.items():
        setattr(o, key, value)
    return o


def images(paths):
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sorted(paths)])


def test_cli_writes_named_images_with_metadata(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --d 5\n# skip\na (blue:1.2) dog --ss ddim --s 3\n")
    out = tmp_path / "out"
    code = tool.main(["--ckpt", "tiny:sd1", "--outdir", str(out), "--from_file", str(prompts), "--device", "cpu",
                      "--images_per_prompt", "2", "--seed", "100", "--batch_size", "2", "--grid", *ARGS])
    assert code == 0
    assert capsys.readouterr().out.startswith(f"wrote 5 image(s) to {out}")
    names = sorted(re.sub(r"_\d{14}", "_<ts>", os.path.basename(p)) for p in glob.glob(str(out / "*.png")))
    # --d 5 seeds the first prompt (5, 6); --seed 100 seeds the rest by image number (102, 103)
    assert names == ["im_00_<ts>_5.png", "im_01_<ts>_6.png", "im_02_<ts>_102.png", "im_03_<ts>_103.png",
                     "im_grid.png"]
    meta = read_png_text(glob.glob(str(out / "im_02_*.png"))[0])
    assert {k: meta[k] for k in ("prompt", "seed", "steps", "scale", "sampler", "width", "height", "model")} == {
        "prompt": "a (blue:1.2) dog", "seed": "102", "steps": "3", "scale": "4.0", "sampler": "ddim",
        "width": "64", "height": "64", "model": "tiny:sd1"}
    assert not glob.glob(str(out / ".*"))


def test_lora_at_multiplier_zero_equals_the_base(tmp_path, loaded, lora_file):
    base = tool.run(options(tmp_path / "base", seed=1), loaded)
    zero = tool.run(options(tmp_path / "zero", seed=1, networks=[NetworkSpec("networks.lora", lora_file, 0.0)]),
                    loaded)
    full = tool.run(options(tmp_path / "full", seed=1, networks=[NetworkSpec("networks.lora", lora_file, 1.0)]),
                    loaded)
    assert np.array_equal(images(base), images(zero))
    assert not np.array_equal(images(base), images(full))
    # the networks were removed again: the model is the base model
    assert np.array_equal(images(base), images(tool.run(options(tmp_path / "again", seed=1), loaded)))
    assert read_png_text(full[0])["networks"] == "toy.safetensors:1.0"


def test_merge_equals_unmerged(tmp_path, loaded, lora_file):
    family, c, device = loaded
    spec = [NetworkSpec("networks.lora", lora_file, 0.7)]
    hooked = images(tool.run(options(tmp_path / "hooked", seed=3, networks=spec), loaded))
    fresh = (family, copy.deepcopy(c), device)  # merging changes the weights for good
    merged = images(tool.run(options(tmp_path / "merged", seed=3, networks=spec, merge=True), fresh))
    base = images(tool.run(options(tmp_path / "base", seed=3), loaded))
    diff = np.abs(hooked.astype(int) - merged.astype(int))
    assert diff.max() <= 2, diff.max()
    assert np.abs(hooked.astype(int) - base.astype(int)).max() > 10  # the LoRA does change the image


def test_network_flags_pair_up():
    assert network_specs([], ["a.safetensors", "b.safetensors"], [0.5]) == [
        NetworkSpec("networks.lora", "a.safetensors", 0.5), NetworkSpec("networks.lora", "b.safetensors", 1.0)]
    assert network_specs(["lycoris.kohya", "networks.lora"], ["a", "b"], [1, 2])[0].module == "lycoris.kohya"
    with pytest.raises(ConfigError, match=r"^--network_module: expected 1 or 2 values \(one per --network_weights"):
        network_specs(["x", "y", "z"], ["a", "b"], [])
    with pytest.raises(ConfigError, match=r"^--network_mul: expected at most 1 values"):
        network_specs([], ["a"], [1.0, 2.0])
    with pytest.raises(ConfigError, match=r"^--network_mul: given without --network_weights$"):
        network_specs([], [], [1.0])


@pytest.mark.parametrize("argv,message", [
    (["--flux", "--sdxl"], "error: --sdxl and --flux: expected at most one"),
    (["--from_file", "p.txt"], "error: expected exactly one of --prompt or --from_file"),
    (["--steps", "0"], "error: --steps: expected an integer >= 1, got 0"),
    (["--network_weights", "missing.safetensors"], "error: --network_weights missing.safetensors: file not found"),
])
def test_flag_errors_are_one_line(tmp_path, capsys, argv, message):
    code = tool.main(["--ckpt", "tiny:sd1", "--outdir", str(tmp_path), "--prompt", "a cat", "--device", "cpu",
                      *argv])
    assert code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message) and "Traceback" not in err, err
