"""tools/convert_diffusers20_original_sd.py: single file <-> diffusers folder through the families' own loaders and
writers; round trips on the tiny presets are bitwise."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tools import convert_diffusers20_original_sd as convert


def _folder_tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".safetensors"):
                part = os.path.relpath(root, folder)
                out.update({f"{part}/{k}": v for k, v in load_file(os.path.join(root, name)).items()})
    return out


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("fixture", ["tiny_sd1_file", "tiny_sdxl_file"])
def test_file_to_folder_to_file_is_bitwise(tmp_path, request, fixture):
    src = request.getfixturevalue(fixture)
    folder, back = str(tmp_path / "folder"), str(tmp_path / "back.safetensors")
    assert convert.main([src, folder, "--use_safetensors"]) == 0
    assert os.path.isfile(os.path.join(folder, "model_index.json"))
    assert os.path.isfile(os.path.join(folder, "unet", "diffusion_pytorch_model.safetensors"))
    assert convert.main([folder, back]) == 0
    _same(load_file(src), load_file(back))


def test_folder_to_file_to_folder_is_bitwise_sdxl(tmp_path, tiny_sdxl_folder):
    file, back = str(tmp_path / "m.safetensors"), str(tmp_path / "back")
    assert convert.main([tiny_sdxl_folder, file]) == 0
    assert convert.main([file, back, "--use_safetensors"]) == 0
    _same(_folder_tensors(tiny_sdxl_folder), _folder_tensors(back))


def test_precision_metadata_and_ckpt(tmp_path, tiny_sd1_file):
    half = str(tmp_path / "half.safetensors")
    assert convert.main([tiny_sd1_file, half, "--v1", "--save_precision_as", "fp16",
                         "--metadata", "{'name': 'tiny', 'resolution': '64x64'}"]) == 0
    src, out = load_file(tiny_sd1_file), load_file(half)
    assert sorted(out) == sorted(src)
    floats = [k for k in src if src[k].is_floating_point()]
    assert floats and all(out[k].dtype == torch.float16 and torch.equal(out[k], src[k].half()) for k in floats)
    from safetensors import safe_open

    with safe_open(half, "pt") as f:
        assert {"name": "tiny", "resolution": "64x64"}.items() <= f.metadata().items()
    ckpt = str(tmp_path / "m.ckpt")
    assert convert.main([tiny_sd1_file, ckpt, "--epoch", "3", "--global_step", "120"]) == 0
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (3, 120) and sorted(saved["state_dict"]) == sorted(src)


@pytest.mark.parametrize("argv,error", [
    (["{src}", "{out}", "--v1", "--v2"], "error: --v1 and --v2: give one"),
    (["{src}", "{out}", "--fp16", "--bf16"], "error: --fp16 and --bf16: give one save precision"),
    (["{src}", "{out}", "--bf16", "--save_precision_as", "fp16"], "error: --save_precision_as fp16: conflicts with --bf16"),
    (["{src}", "{out}", "--metadata", "name=x"], "error: --metadata: expected a Python dict literal"),
    (["{src}", "{dir}/m.ckpt", "--metadata", "{{'a': 1}}"], "error: --metadata: only a .safetensors file carries metadata"),
    (["{dir}/none.safetensors", "{out}"], "error: model_to_load: {dir}/none.safetensors: no such file or folder"),
    (["{src}", "{dir}/m.bin"], "error: model_to_save: {dir}/m.bin: expected .safetensors or .ckpt"),
    (["{src}", "{src}"], "error: model_to_save: {src} is the model to load"),
    (["{src}", "{out}", "--variant", "fp16"], "error: --variant fp16: not supported"),
    (["{src}", "{out}", "--reference_model", "x"], "error: --reference_model: not supported"),
    (["{src}", "{out}", "--v2"], "error: --v2: {src} is an SD 1.x model"),
])
def test_bad_input_is_one_line(tmp_path, capsys, tiny_sd1_file, argv, error):
    names = {"src": tiny_sd1_file, "out": str(tmp_path / "out"), "dir": str(tmp_path)}
    assert convert.main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(error.format(**names)) and "\n" not in err
    assert not os.path.exists(names["out"])


def test_takes_every_sd_scripts_flag():
    ours = {s for a in convert.setup_parser()._actions for s in (a.option_strings or [a.dest])}
    assert {"--v1", "--v2", "--unet_use_linear_projection", "--fp16", "--bf16", "--float", "--save_precision_as",
            "--epoch", "--global_step", "--metadata", "--variant", "--reference_model", "--use_safetensors",
            "model_to_load", "model_to_save"} <= ours
