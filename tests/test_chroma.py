"""Chroma through flux_train_network.py --model_type chroma: LoRA keys, the single-file layout, a few LoRA steps."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.cli.entry import run_training
from library.families import get_family
from library.families.base import Components
from library.families.chroma.family import joint_attention_mask
from library.families.chroma.model import (
    build_chroma_modules,
    chroma_from_single_file,
    chroma_to_single_file,
    load_chroma_transformer,
)
from library.families.flux.options import FluxOptions
from networks.lora import create_network
from tests.train_helpers import base_args, make_dataset

CHROMA_FLAGS = ["--model_type", "chroma", "--apply_t5_attn_mask", "--guidance_scale", "0",
                "--t5xxl_max_token_length", "8"]
DOUBLE_LAYERS = ("img_attn_qkv", "img_attn_proj", "img_mlp_0", "img_mlp_2",
                 "txt_attn_qkv", "txt_attn_proj", "txt_mlp_0", "txt_mlp_2")
SINGLE_LAYERS = ("linear1", "linear2")


def _expected_lora_names(double: int, single: int) -> set[str]:
    """sd-scripts' lora_flux.py on Chroma: every Linear of each DoubleStreamBlock / SingleStreamBlock (no
    modulation layers there: Chroma's modulation comes from its approximator), nothing outside the blocks."""
    return ({f"lora_unet_double_blocks_{i}_{n}" for i in range(double) for n in DOUBLE_LAYERS}
            | {f"lora_unet_single_blocks_{i}_{n}" for i in range(single) for n in SINGLE_LAYERS})


def _components(parts: dict) -> Components:
    c = Components(parts["transformer"], parts["vae"], [parts["text_encoder"]], [parts["tokenizer"]])
    c.options = FluxOptions(apply_t5_attn_mask=True, guidance_scale=0.0, model_type="chroma")
    return c


def test_full_size_lora_keys_equal_sd_scripts_on_meta():
    c = _components(build_chroma_modules("random:chroma", device="meta"))
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=get_family("chroma").lora_targets(c))
    names = {lora.lora_name for lora in net.unet_loras}
    assert len(names) == 228 and names == _expected_lora_names(19, 38)
    assert net.text_encoder_loras == []  # no CLIP-L; T5 only with train_t5xxl=True
    ups = {lora.lora_name: lora.lora_up.weight.shape[0] for lora in net.unet_loras}
    assert ups["lora_unet_double_blocks_0_img_attn_qkv"] == 3 * 3072
    assert ups["lora_unet_single_blocks_37_linear1"] == 3 * 3072 + 4 * 3072
    assert ups["lora_unet_double_blocks_18_txt_mlp_0"] == 4 * 3072
    t5 = create_network(1.0, 4, 1, None, None, None, lora_targets=[get_family("chroma").t5_lora_target(c)])
    assert len(t5.text_encoder_loras) == 168  # lora_te3_*, as FLUX.1's T5


def test_full_size_single_file_layout_is_what_diffusers_reads_on_meta():
    """Our writer's key set, read by diffusers' own Chroma converter, is exactly ChromaTransformer2DModel's."""
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers,
    )

    model = build_chroma_modules("random:chroma", device="meta")["transformer"]
    written = chroma_to_single_file(model.state_dict())
    # 19 double blocks x 20 tensors, 38 single x 6, the approximator (in/out 4 + 5 layers x 5), img_in, txt_in, final 6
    assert len(written) == 19 * 20 + 38 * 6 + 4 + 5 * 5 + 6 == 643
    assert {"distilled_guidance_layer.layers.4.out_layer.weight", "distilled_guidance_layer.norms.0.scale",
            "double_blocks.18.txt_attn.qkv.bias", "single_blocks.37.linear1.weight", "final_layer.linear.weight",
            "img_in.weight", "txt_in.bias"} <= set(written)
    assert written["double_blocks.0.img_attn.qkv.weight"].shape == (9216, 3072)
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(dict(written))
    ours = chroma_from_single_file(written)
    assert set(theirs) == set(ours) == set(model.state_dict())
    assert all(theirs[k].shape == ours[k].shape for k in ours)


def test_joint_attention_mask_keeps_one_padding_token():
    mask = joint_attention_mask(torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]), 2)
    assert mask.tolist() == [[True, True, True, True, False, False, True, True], [True] * 8]


def test_lora_steps_end_to_end_from_the_single_file(tmp_path, tiny_flux_files):
    """flux_train_network.py --model_type chroma on tiny:chroma as tools/make_tiny_model.py writes it (single file,
    t5xxl and ae files): 2 steps, the file has sd-scripts' keys and Chroma's metadata."""
    from tools.make_tiny_model import main

    assert main(["--family", "chroma", "--out", str(tmp_path / "model"), "--single_file"]) == 0
    files = {name: str(tmp_path / "model" / f"{name}.safetensors") for name in ("chroma-tiny", "t5xxl", "ae")}
    for name in ("t5xxl", "ae"):  # tiny:chroma's T5 and AE are tiny:flux's, so its files are the same
        assert load_file(files[name]).keys() == load_file(tiny_flux_files[name]).keys()
        assert all(torch.equal(a, b) for a, b in zip(load_file(files[name]).values(),
                                                     load_file(tiny_flux_files[name]).values()))
    data = make_dataset(str(tmp_path / "data"), n=2)
    argv = base_args(data, str(tmp_path / "out"), preset=files["chroma-tiny"], steps=2, extra=CHROMA_FLAGS + [
        "--t5xxl", files["t5xxl"], "--ae", files["ae"], "--network_module", "networks.lora_flux"])
    assert run_training("flux", "test", argv) == 0
    path = os.path.join(str(tmp_path / "out"), "lora.safetensors")
    sd = load_file(path)
    modules = _expected_lora_names(2, 3)
    assert set(sd) == {f"{m}.{k}" for m in modules for k in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert sd["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (3 * 32 + 4 * 32, 4)
    assert all(sd[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)  # every module trained
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["modelspec.architecture"], meta["ss_model_type"],
            meta["ss_network_module"], meta["modelspec.implementation"]) == (
        "chroma", "chroma/lora", "chroma", "networks.lora_flux", "https://huggingface.co/lodestones/Chroma")


@pytest.mark.parametrize("flags,error", [
    (["--model_type", "chroma", "--guidance_scale", "0"],
     "error: --model_type chroma: needs --apply_t5_attn_mask (Chroma masks T5 padding; sd-scripts requires it too)"),
    (["--model_type", "chroma", "--apply_t5_attn_mask"],
     "error: --guidance_scale 3.5: Chroma is not guidance-distilled; give --guidance_scale 0 (as sd-scripts' docs ask)"),
    (CHROMA_FLAGS + ["--clip_l", "clip_l.safetensors"], "error: --clip_l: Chroma has no CLIP-L text encoder; drop the flag"),
])
def test_chroma_flags_refused_with_one_line(tmp_path, capsys, flags, error):
    data = make_dataset(str(tmp_path), n=1)
    assert run_training("flux", "test", base_args(data, str(tmp_path / "o"), preset="tiny:chroma", extra=flags)) == 2
    assert capsys.readouterr().err.strip() == error


def test_full_fine_tune_saves_the_single_file_it_loads_back(tmp_path):
    """flux_train.py --model_type chroma (here with --blockwise_fused_optimizers): the saved file loads back
    equal to the trained transformer."""
    from tests.train_helpers import ft_args, ft_trainer

    data = make_dataset(str(tmp_path), n=1)
    trainer = ft_trainer(ft_args(data, str(tmp_path / "out"), "tiny:chroma", steps=1, extra=CHROMA_FLAGS + [
        "--blockwise_fused_optimizers", "--optimizer_type", "AdamW"]), "chroma")
    path = trainer.run()
    assert trainer.optimizer.optimizer.chunk_names[:2] == ["denoiser other", "denoiser double_blocks.0"]
    want, got = trainer.components.denoiser.state_dict(), load_chroma_transformer(path).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_cache_tool_writes_chroma_text_files(tmp_path):
    """tools/cache_text_encoder_outputs.py --flux --model_type chroma: T5 outputs only, in `_chroma_te.npz`."""
    import numpy as np

    from tools.cache_text_encoder_outputs import main

    data = make_dataset(str(tmp_path), n=1)
    assert main(["--flux", "--pretrained_model_name_or_path", "tiny:chroma", "--train_data_dir", data,
                 "--caption_extension", ".txt", "--resolution", "64", "--max_data_loader_n_workers", "0",
                 "--cache_text_encoder_outputs_to_disk", *CHROMA_FLAGS]) == 0
    with np.load(os.path.join(data, "5_sks toy", "img0_chroma_te.npz")) as f:
        assert {"t5_out", "txt_ids", "t5_attn_mask"} <= set(f.files) and "l_pooled" not in f.files
        assert f["t5_out"].shape[-2:] == (8, 32)
