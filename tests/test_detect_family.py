"""tools/generate.py picks the family from the model path when --sdxl / --flux are not given."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from library.families.detect import detect_family


@pytest.mark.parametrize("preset,family", [("tiny:sd1", "sd"), ("random:sd15", "sd"), ("tiny:sdxl", "sdxl"),
                                           ("tiny:flux", "flux"), ("tiny:nope", None)])
def test_presets(preset, family):
    assert detect_family(preset) == family


def test_single_files_by_their_keys(tmp_path):
    cases = {"sd": ["model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.x"],
             "sdxl": ["model.diffusion_model.input_blocks.0.0.weight", "conditioner.embedders.0.x"],
             "flux": ["double_blocks.0.img_attn.qkv.weight"]}
    for family, keys in cases.items():
        path = str(tmp_path / f"{family}.safetensors")
        save_file({k: torch.zeros(1) for k in keys}, path)
        assert detect_family(path) == family
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(1)}, str(tmp_path / "lora.safetensors"))
    assert detect_family(str(tmp_path / "lora.safetensors")) is None
    assert detect_family(str(tmp_path / "missing.safetensors")) is None


def test_real_layouts_written_by_the_tools(tiny_sd1_file, tiny_sdxl_folder):
    # written by write_preset("tiny:sd1", ..., single_file=True) and write_sdxl_preset("tiny:sdxl", folder)
    assert detect_family(tiny_sd1_file) == "sd"
    assert detect_family(tiny_sdxl_folder) == "sdxl"


def test_generate_tool_uses_the_detected_family(tmp_path):
    from tools import generate

    args = generate.build_parser().parse_args(["--ckpt", "tiny:sdxl", "--outdir", str(tmp_path), "--prompt", "a cat"])
    assert generate.options_from_args(args).family == "sdxl"
    args = generate.build_parser().parse_args(["--ckpt", "tiny:sd1", "--outdir", str(tmp_path), "--prompt", "a cat"])
    assert generate.options_from_args(args).family == "sd"
