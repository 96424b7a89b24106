"""sd-scripts' small tools: networks/check_lora_weights.py, tools/merge_models.py and
tools/resize_images_to_resolution.py (flags, output, one-line errors, atomic writes)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from networks import check_lora_weights
from tools import merge_models, resize_images_to_resolution


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


# --- check_lora_weights -------------------------------------------------------------------------------------------

def test_check_lora_weights_prints_sd_scripts_lines(tmp_path, capsys):
    path = str(tmp_path / "l.safetensors")
    save_file({"lora_unet_a.lora_down.weight": torch.tensor([[1.0, -3.0], [0.5, 2.0]]),
               "lora_unet_a.lora_up.weight": torch.zeros(3, 2),
               "lora_unet_a.alpha": torch.tensor(2.0),
               "lora_unet_b.hada_w1_a": torch.tensor([[-4.0, 2.0]])}, path)
    assert check_lora_weights.main([path]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "number of LoRA modules: 3",
        "lora_unet_a.lora_down.weight,(2-2),1.625,0.5",
        "lora_unet_a.lora_up.weight,(3-2),0.0,0.0",  # an up never trained: mean and min 0
        "lora_unet_b.hada_w1_a,(1-2),3.0,2.0",  # LyCORIS LoHa weights count too
    ]
    assert check_lora_weights.main([path, "-s", "--show_max"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["number of LoRA modules: 3", "number of all modules: 4"]
    assert out[2] == "lora_unet_a.lora_down.weight,(2-2),1.625,0.5,3.0"
    assert out[-1] == "lora_unet_a.alpha,(),2.0,2.0,2.0"


def test_check_lora_weights_on_a_network_file(tmp_path, capsys, tiny_sd1):
    """A file networks.lora writes: every lora_down / lora_up listed (not alpha), ups all zero before training."""
    from library.families import get_family
    from networks.lora import create_network

    c = tiny_sd1
    net = create_network(1.0, 4, 1.0, None, c.text_encoders, c.denoiser, lora_targets=get_family("sd").lora_targets(c))
    path = str(tmp_path / "net.safetensors")
    net.save_weights(path, None, {})
    assert check_lora_weights.main([path]) == 0
    out = capsys.readouterr().out.splitlines()
    modules = len(net.text_encoder_loras) + len(net.unet_loras)
    assert out[0] == f"number of LoRA modules: {2 * modules}" and len(out) == 2 * modules + 1
    ups = [line for line in out[1:] if ".lora_up." in line]
    assert len(ups) == modules and all(line.endswith(",0.0,0.0") for line in ups)


def test_check_lora_weights_bad_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"not a pickle")
    assert check_lora_weights.main([str(bad)]) == 2
    assert _one_error_line(capsys).startswith(f"error: {bad}: not a safetensors file nor a torch file of tensors")
    assert check_lora_weights.main([str(tmp_path / "missing.safetensors")]) == 2
    assert _one_error_line(capsys) == f"error: {tmp_path / 'missing.safetensors'}: file not found"


# --- merge_models -------------------------------------------------------------------------------------------------

def _model(path, seed, extra=None, drop=()):
    g = torch.Generator().manual_seed(seed)
    sd = {"model.diffusion_model.w": torch.randn(4, 3, generator=g),
          "model.diffusion_model.b": torch.randn(3, generator=g).to(torch.float16),
          "first_stage_model.enc": torch.randn(2, 2, generator=g),
          "cond_stage_model.transformer.embeddings.position_ids": torch.arange(5)}
    sd.update(extra or {})
    for key in drop:
        del sd[key]
    save_file(sd, str(path))
    return sd


def test_merge_models_weighted_sum(tmp_path, capsys):
    a = _model(tmp_path / "a.safetensors", 0)
    b = _model(tmp_path / "b.safetensors", 1, extra={"only_in_b": torch.ones(1)})
    out = tmp_path / "m"
    assert merge_models.main(["--models", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
                              "--ratios", "0.75", "0.25", "--output", str(out), "--show_skipped"]) == 0
    m = load_file(str(out) + ".safetensors")  # .safetensors appended, as sd-scripts
    # only_in_b skipped; SD 1.x text encoder keys written with text_model. (sd-scripts' replace_text_encoder_key)
    assert sorted(m) == sorted(["model.diffusion_model.w", "model.diffusion_model.b", "first_stage_model.enc",
                                "cond_stage_model.transformer.text_model.embeddings.position_ids"])
    for key in ("model.diffusion_model.w", "model.diffusion_model.b", "first_stage_model.enc"):
        want = a[key].float() * 0.75 + b[key].float() * 0.25  # float32 arithmetic, then the saving dtype (float)
        assert m[key].dtype == torch.float32 and torch.equal(m[key], want)
    assert torch.equal(m["cond_stage_model.transformer.text_model.embeddings.position_ids"], torch.arange(5))  # ints kept
    assert "Skip: only_in_b" in capsys.readouterr().out
    assert oct(os.stat(str(out) + ".safetensors").st_mode & 0o777) == oct(0o666 & ~_umask())
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temporary left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_merge_models_default_ratios_unet_only_missing_keys_and_precision(tmp_path):
    a = _model(tmp_path / "a.safetensors", 0)
    b = _model(tmp_path / "b.safetensors", 1, drop=("model.diffusion_model.b",))
    c = _model(tmp_path / "c.safetensors", 2)
    out = str(tmp_path / "m.safetensors")
    assert merge_models.main(["--models", *(str(tmp_path / f"{n}.safetensors") for n in "abc"), "--unet_only",
                              "--saving_precision", "fp16", "--output", out]) == 0
    m = load_file(out)
    third = 1.0 / 3
    want_w = a["model.diffusion_model.w"] * third + b["model.diffusion_model.w"] * third \
        + c["model.diffusion_model.w"] * third
    assert torch.equal(m["model.diffusion_model.w"], want_w.half())
    # b lacks the bias: the first model's value stands in for b's third (sd-scripts)
    want_b = a["model.diffusion_model.b"].float() * third * 2 + c["model.diffusion_model.b"].float() * third
    torch.testing.assert_close(m["model.diffusion_model.b"].float(), want_b.half().float(), rtol=0, atol=1e-3)
    assert torch.equal(m["first_stage_model.enc"], a["first_stage_model.enc"].half())  # --unet_only: the first's


def test_merge_models_streams_one_key_at_a_time(tmp_path, monkeypatch):
    """Each input tensor is read once, when its key is merged: at most one tensor per model is alive at a time."""
    _model(tmp_path / "a.safetensors", 0)
    _model(tmp_path / "b.safetensors", 1)
    from safetensors import safe_open as real_open

    reads = []

    class Spy:
        def __init__(self, path, **kw):
            self.f = real_open(path, **kw)
            self.path = path

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return self.inner.get_slice(key)

        def get_tensor(self, key):
            reads.append((os.path.basename(self.path), key))
            return self.inner.get_tensor(key)

    monkeypatch.setattr("safetensors.safe_open", Spy)
    assert merge_models.main(["--models", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
                              "--output", str(tmp_path / "m.safetensors")]) == 0
    # key by key: each float key's tensor from a, then from b, never all of a first; position_ids (int) from a only
    floats = ["model.diffusion_model.w", "model.diffusion_model.b", "first_stage_model.enc"]
    pairs = [r for r in reads if r[1] != "cond_stage_model.transformer.embeddings.position_ids"]
    assert sorted(pairs[0::2], key=lambda r: r[1]) == sorted([("a.safetensors", k) for k in floats], key=lambda r: r[1])
    assert all(pairs[i][1] == pairs[i + 1][1] and pairs[i + 1][0] == "b.safetensors" for i in range(0, 6, 2))
    assert len(reads) == 2 * 3 + 1


@pytest.mark.parametrize("argv,error", [
    (["--models", "{a}", "{b}", "--ratios", "1", "--output", "{o}"], "error: --ratios: expected one ratio per model (2), got 1"),
    (["--models", "{a}", "{dir}/nope.safetensors", "--output", "{o}"], "error: --models: {dir}/nope.safetensors: file not found"),
    (["--models", "{a}", "{dir}/x.ckpt", "--output", "{o}"], "error: --models: {dir}/x.ckpt: expected a .safetensors file"),
    (["--models", "{a}", "{big}", "--output", "{o}"], "error: --models: {big}: model.diffusion_model.w has shape [5, 3], "
                                                      "the first model [4, 3]"),
    (["--models", "{a}", "{b}", "--ratios", "nan", "1", "--output", "{o}"], "error: --ratios: expected finite numbers, got nan"),
    (["--models", "{a}", "{b}", "--output", "{a}"], "error: --output: {a} is one of the --models"),
])
def test_merge_models_bad_input_one_line_before_work(tmp_path, capsys, argv, error):
    _model(tmp_path / "a.safetensors", 0)
    _model(tmp_path / "b.safetensors", 1)
    _model(tmp_path / "big.safetensors", 1, extra={"model.diffusion_model.w": torch.zeros(5, 3)})
    names = {"a": str(tmp_path / "a.safetensors"), "b": str(tmp_path / "b.safetensors"),
             "big": str(tmp_path / "big.safetensors"), "o": str(tmp_path / "out.safetensors"), "dir": str(tmp_path)}
    assert merge_models.main([x.format(**names) for x in argv]) == 2
    assert _one_error_line(capsys).startswith(error.format(**names))
    assert not os.path.exists(names["o"])


# --- resize_images_to_resolution ----------------------------------------------------------------------------------

def _image(path, w, h, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)


def test_resize_images_sizes_names_and_associated_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _image(src / "wide.png", 300, 100)
    _image(src / "small.jpg", 40, 30, seed=1)
    (src / "wide.txt").write_text("a caption")
    (src / "notes.md").write_text("x")
    assert resize_images_to_resolution.main([str(src), str(dst), "--max_resolution", "128x128,64x64",
                                             "--divisible_by", "8", "--save_as_png", "--copy_associated_files"]) == 0
    assert sorted(os.listdir(dst)) == sorted([
        "notes.md", "wide.txt",  # every non-image file copied as it is
        "wide+128x128.png", "wide+64x64.png", "wide+128x128.txt", "wide+64x64.txt",
        "small+128x128.png", "small+64x64.png"])
    # 300x100 = 30000 px > 16384: scale √(16384/30000) -> 221x73 (int), cropped to multiples of 8 -> 216x72
    assert Image.open(dst / "wide+128x128.png").size == (216, 72)
    # 4096 px: 110x36 -> 104x32, from the original (not from the 128x128 result as sd-scripts does)
    assert Image.open(dst / "wide+64x64.png").size == (104, 32)
    # smaller than both: not resized, only cropped to multiples of 8 (40x30 -> 40x24, centred: rows 3..27)
    small = np.array(Image.open(dst / "small+64x64.png"))
    assert small.shape == (24, 40, 3)
    assert np.array_equal(small, np.array(Image.open(src / "small.jpg").convert("RGB"))[3:27])
    assert (dst / "wide+64x64.txt").read_text() == "a caption"


def test_resize_images_jpeg_default_and_filter(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _image(src / "a.png", 64, 64)
    assert resize_images_to_resolution.main([str(src), str(dst), "--max_resolution", "32x32",
                                             "--interpolation", "lanczos4"]) == 0
    out = Image.open(dst / "a+32x32.jpg")
    assert out.format == "JPEG" and out.size == (32, 32)


@pytest.mark.parametrize("argv,error", [
    (["{src}", "{dst}", "--max_resolution", "512"], "error: --max_resolution: expected WIDTHxHEIGHT values like "
                                                    "512x512,384x384, got '512'"),
    (["{src}", "{dst}", "--max_resolution", "64x64,0x5"], "error: --max_resolution: expected WIDTHxHEIGHT"),
    (["{src}", "{dst}", "--divisible_by", "0"], "error: --divisible_by: expected an integer >= 1, got 0"),
    (["{tmp}/none", "{dst}"], "error: {tmp}/none: not a folder"),
    (["{src}", "{src}"], "error: {src}: the destination must differ from the source folder"),
    (["{src}", "{dst}", "--max_resolution", "4x4", "--divisible_by", "16"],
     "error: {src}/a.png: 20x10 leaves nothing at 4x4 with --divisible_by 16"),
])
def test_resize_images_bad_input_one_line_before_work(tmp_path, capsys, argv, error):
    src = tmp_path / "src"
    src.mkdir()
    _image(src / "a.png", 20, 10)
    (src / "a.txt").write_text("c")
    names = {"src": str(src), "dst": str(tmp_path / "dst"), "tmp": str(tmp_path)}
    assert resize_images_to_resolution.main([x.format(**names) for x in argv]) == 2
    assert _one_error_line(capsys).startswith(error.format(**names))
    assert not (tmp_path / "dst").exists()


def test_resize_images_unreadable_image_stops_before_writing(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _image(src / "a.png", 20, 10)
    (src / "b.png").write_bytes(b"garbage")
    assert resize_images_to_resolution.main([str(src), str(dst)]) == 2
    assert _one_error_line(capsys).startswith(f"error: {src / 'b.png'}: not a readable image")
    assert not dst.exists()


# sd-scripts 48d368fa's options of each tool (setup_parser / __main__), read from its sources
SD_SCRIPTS_TOOL_FLAGS = {
    check_lora_weights: {"file", "-s", "--show_all_keys"},
    merge_models: {"--models", "--output", "--ratios", "--unet_only", "--device", "--precision", "--saving_precision",
                   "--show_skipped"},
    resize_images_to_resolution: {"src_img_folder", "dst_img_folder", "--max_resolution", "--divisible_by",
                                  "--interpolation", "--save_as_png", "--copy_associated_files"},
}


@pytest.mark.parametrize("tool", list(SD_SCRIPTS_TOOL_FLAGS), ids=lambda t: t.__name__)
def test_tools_take_every_sd_scripts_flag(tool):
    ours = {s for a in tool.setup_parser()._actions for s in (a.option_strings or [a.dest])}
    assert SD_SCRIPTS_TOOL_FLAGS[tool] <= ours
