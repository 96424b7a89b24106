"""The LoRA tools on HunyuanImage 2.1 files (tiny:hunyuan_image in the original single-file layouts):
tools/generate.py with a LoRA applied equals the same generation from the merge_lora'd DiT file; resize_lora
keeps every module's name and reduces its rank; show_metadata reads the file."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open

from library.families import get_family
from tests.train_helpers import random_lora_file
from tools import generate as tool


def _generate(tmp_path, name: str, argv: list[str]) -> np.ndarray:
    out = tmp_path / name
    args = tool.build_parser().parse_args(argv + ["--outdir", str(out), "--prompt", 'a sign saying "HI" --d 5',
                                                  "--W", "64", "--H", "64", "--steps", "2", "--device", "cpu"])
    o = tool.options_from_args(args)
    assert o.family == "hunyuan_image"  # told by the DiT file's keys
    (path,) = tool.run(o)
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def test_generate_with_a_lora_equals_the_merged_file(tmp_path, hi_files, tiny_hi):  # noqa: F811
    from tools import merge_lora

    lora = random_lora_file(get_family("hunyuan_image"), tiny_hi, str(tmp_path / "lora.safetensors"), seed=5)
    parts = ["--text_encoder", hi_files["text_encoder"], "--byt5", hi_files["byt5"], "--vae", hi_files["vae"]]
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", hi_files["dit"], "--text_encoder", hi_files["text_encoder"], "--byt5",
                            hi_files["byt5"], "--models", lora, "--ratios", "1.0", "--save_to", merged]) == 0
    plain = _generate(tmp_path, "plain", ["--ckpt", hi_files["dit"], *parts])
    applied = _generate(tmp_path, "applied", ["--ckpt", hi_files["dit"], *parts, "--network_module",
                                              "networks.lora_hunyuan_image", "--network_weights", lora])
    from_merged = _generate(tmp_path, "merged", ["--ckpt", merged, *parts])
    assert plain.std() > 0 and np.abs(applied - plain).max() > 8  # the LoRA changes the image
    assert np.abs(applied - from_merged).max() <= 1  # applied at run time = merged into the file


def test_resize_and_show_metadata(tmp_path, tiny_hi, capsys):  # noqa: F811
    from tools import resize_lora, show_metadata

    lora = random_lora_file(get_family("hunyuan_image"), tiny_hi, str(tmp_path / "lora.safetensors"), seed=6)
    out = str(tmp_path / "resized.safetensors")
    assert resize_lora.main(["--model", lora, "--save_to", out, "--new_rank", "2"]) == 0
    with safe_open(lora, "pt") as f:
        before = {k.split(".")[0] for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    with safe_open(out, "pt") as f:
        after = {k.split(".")[0] for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
        down = f.get_tensor("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight")
        metadata = f.metadata()
    assert after == before and len(after) == 32  # tiny: 2 double x 10 + 4 single x 3 modules
    assert down.shape[0] == 2 and metadata["ss_network_dim"] == "2"
    capsys.readouterr()
    assert show_metadata.main([out, "--keys"]) == 0
    printed = capsys.readouterr().out
    assert "Dimension resized from 4 to 2" in printed and "lora_unet_single_blocks_3_linear2.lora_up.weight" in printed


def test_convert_to_comfy_writes_comfyuis_names(tmp_path, tiny_hi):  # noqa: F811
    """tools/convert_lora.py --to comfy on a HunyuanImage LoRA: ComfyUI's names (sd-scripts'
    convert_hunyuan_image_lora_to_comfy.py: *_mlp_fc1/fc2 -> *_mlp_0/_2, *_mod_linear / modulation_linear ->
    *_lin; the attention and linear1/linear2 names stay), the same tensors; the family reads it back as before."""
    from safetensors.torch import load_file

    from tools import convert_lora

    family = get_family("hunyuan_image")
    src = random_lora_file(family, tiny_hi, str(tmp_path / "lora.safetensors"), seed=7)
    dst = str(tmp_path / "comfy.safetensors")
    assert convert_lora.main(["--src_path", src, "--dst_path", dst, "--to", "comfy"]) == 0
    original, comfy = load_file(src), load_file(dst)
    names = {k.split(".")[0] for k in comfy}
    assert {"lora_unet_double_blocks_0_img_mlp_0", "lora_unet_double_blocks_0_img_mlp_2",
            "lora_unet_double_blocks_1_txt_mod_lin", "lora_unet_single_blocks_3_modulation_lin",
            "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"} <= names
    assert not [n for n in names if n.endswith(("_fc1", "_fc2", "_linear"))] and len(names) == 32
    back = family.convert_lora_state_dict(comfy)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    # A FLUX.1-named file (img_mlp_0 is FLUX.1's own kohya name) is not HunyuanImage's: --to comfy refuses it.
    flux_named = str(tmp_path / "flux_named.safetensors")
    from safetensors.torch import save_file

    save_file({k: v for k, v in comfy.items() if "double_blocks_0_img_mlp_0" in k}, flux_named)
    assert convert_lora.main(["--src_path", flux_named, "--dst_path", str(tmp_path / "x.safetensors"),
                              "--to", "comfy"]) != 0
