"""Qwen-Image: the tiny preset written as a diffusers folder and as ComfyUI's split files and loaded back by the real
loaders (diffusers' QwenImagePipeline included), text as the pipeline encodes it, musubi-tuner's LoRA names on the
full-size model (meta device), a 2-step LoRA run through qwen_image_train_network.py's family with caches and
sampling, ComfyUI / ai-toolkit LoRA layouts read back, and a full fine-tune saving a single file read back."""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.qwen_image import layout, lora_names
from library.families.qwen_image.configs import build_qwen_image_modules
from library.families.qwen_image.loading import write_qwen_image_preset
from library.families.qwen_image.options import QwenImageOptions
from library.families.qwen_image.text import template_tokens
from networks.lora import create_network
from tests.train_helpers import base_args, make_dataset, make_trainer, random_lora_file

CAPTIONS = ["a red cube", "x"]


@pytest.fixture(scope="module")
def tiny_qi():
    return get_family("qwen_image").load(LoadOptions("tiny:qwen_image"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-files")
    single = write_qwen_image_preset("tiny:qwen_image", str(root / "comfy"), True)
    folder = write_qwen_image_preset("tiny:qwen_image", str(root / "diffusers"), False)["folder"]
    return single, folder


def _velocity(family, c, text):
    latents = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    return family.predict(c, latents, torch.tensor([700.0, 300.0]), text, {})


def test_tiny_files_load_through_the_real_loaders(written, tiny_qi):
    """ComfyUI's split files (DiT in diffusers names, with or without model.diffusion_model., Qwen2.5-VL as model.*
    keys, the VAE in Wan 2.1 names) and the diffusers folder give the preset's exact outputs back."""
    family = get_family("qwen_image")
    single, folder = written
    with safe_open(single["dit"], "pt") as f:
        keys = set(f.keys())
    assert "transformer_blocks.1.img_mod.1.weight" in keys and "norm_out.linear.weight" in keys  # ComfyUI's names
    with safe_open(single["text_encoder"], "pt") as f:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(f.keys())
    assert sorted(os.listdir(folder)) == ["model_index.json", "scheduler", "text_encoder", "tokenizer", "transformer",
                                          "vae"]
    text = family.encode_text(tiny_qi, family.tokenize(tiny_qi, CAPTIONS, None), None)
    expected = _velocity(family, tiny_qi, text)
    prefixed = os.path.join(os.path.dirname(single["dit"]), "whole.safetensors")
    save_file({layout.COMFY_PREFIX + k: v for k, v in load_file(single["dit"]).items()}, prefixed)
    for dit in (single["dit"], prefixed):
        c = family.load(LoadOptions(dit, vae=single["vae"],
                                    family_options=QwenImageOptions(text_encoder=single["text_encoder"])))
        t = family.encode_text(c, family.tokenize(c, CAPTIONS, None), None)
        assert torch.equal(t.tensors["prompt_embeds"], text.tensors["prompt_embeds"])
        assert torch.equal(_velocity(family, c, t), expected)
    c = family.load(LoadOptions(folder))
    t = family.encode_text(c, family.tokenize(c, CAPTIONS, None), None)
    assert torch.equal(_velocity(family, c, t), expected)
    image = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    assert torch.equal(c.vae.encode(image).latent_dist.mean, tiny_qi.vae.encode(image).latent_dist.mean)


def test_vae_in_wan_and_diffusers_names_loads_back_bitwise(written, tiny_qi, tmp_path):
    """--vae takes ComfyUI's qwen_image_vae.safetensors (Wan 2.1 names; the preset writes it so) and the diffusers
    file (vae/diffusion_pytorch_model.safetensors), told apart by the keys: both give the preset's VAE bitwise.
    The tiny VAE has 2 resnets an up block (Qwen-Image's has 3), which diffusers' own Wan converter cannot read."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from library.families.common import wan_vae
    from library.families.qwen_image.loading import load_vae_file

    single, folder = written
    expected = tiny_qi.vae.state_dict()
    with safe_open(single["vae"], "pt") as f:
        keys = set(f.keys())
    assert {"conv1.weight", "conv2.weight", "encoder.conv1.weight", "encoder.downsamples.0.residual.0.gamma",
            "encoder.middle.1.to_qkv.weight", "decoder.upsamples.2.time_conv.weight",
            "decoder.upsamples.10.residual.6.weight", "decoder.head.2.bias"} <= keys  # 4 levels x (2 resnets + 1)
    assert len(keys) == len(expected) == 146 and not any("_blocks" in k for k in keys)
    diffusers_file = str(tmp_path / "diffusion_pytorch_model.safetensors")
    save_file(expected, diffusers_file)
    for path in (single["vae"], diffusers_file, os.path.join(folder, "vae")):
        back = load_vae_file(path, torch.float32).state_dict()
        assert back.keys() == expected.keys() and all(torch.equal(back[k], expected[k]) for k in expected), path
    wan = load_file(single["vae"])
    assert sorted(set(convert_wan_vae_to_diffusers(wan)) - set(expected))[:1] == [
        "decoder.up_blocks.1.resnets.2.conv1.bias"]  # diffusers' converter assumes Wan 2.1's 3 resnets an up block
    full = build_qwen_image_modules("random:qwen_image", device="meta")["vae"].state_dict()
    assert wan_vae.up_block_resnets(full) == 3
    assert list(wan_vae.wan_to_diffusers(wan_vae.to_wan(full))) == list(full)  # the real shape maps back too


def test_text_as_diffusers_pipeline_encodes_it(written, tiny_qi):
    """QwenImagePipeline.from_pretrained on the written folder encodes the captions as we do (its drop index set to
    the tiny tokenizer's template length; 34 is Qwen's): same states bitwise, same mask, zeros after each caption."""
    from diffusers import QwenImagePipeline

    family = get_family("qwen_image")
    _, folder = written
    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.prompt_template_encode_start_idx = template_tokens(pipe.tokenizer)
    embeds, mask = pipe.encode_prompt(CAPTIONS, device="cpu")
    text = family.encode_text(tiny_qi, family.tokenize(tiny_qi, CAPTIONS, None), None).tensors
    n = embeds.shape[1]
    assert text["prompt_embeds"].shape == (2, 1024, 32) and int(text["prompt_mask"].sum()) == int(mask.sum())
    assert torch.equal(text["prompt_embeds"][:, :n], embeds) and torch.equal(text["prompt_mask"][:, :n], mask)
    assert text["prompt_embeds"][:, n:].abs().sum() == 0


def _names(c, **kwargs):
    family = get_family("qwen_image")
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c), **kwargs)
    assert not net.text_encoder_loras
    return [lora.lora_name for lora in net.unet_loras]


def test_full_size_lora_names_on_meta():
    """musubi-tuner's networks.lora_qwen_image on the 20B model: every Linear of the 60 blocks but img_mod / txt_mod
    (12 a block = 720; exclude_mod=False: 14 = 840), named lora_unet_<diffusers path>, which ComfyUI maps onto
    diffusion_model.<path>."""
    family = get_family("qwen_image")
    parts = build_qwen_image_modules("random:qwen_image", device="meta")
    c = Components(parts["transformer"], parts["vae"], [parts["qwen"]], [parts["qwen_tokenizer"]])
    names = _names(c)
    assert len(names) == 60 * 12 == 720
    with_mod = _names(c, exclude_mod="False")
    assert len(with_mod) == 60 * 14 == 840
    linears = {"lora_unet_" + n.replace(".", "_") for n, m in c.denoiser.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")}
    assert set(with_mod) == linears
    assert set(with_mod) - set(names) == {n for n in linears if re.search(r"_(img|txt)_mod_1$", n)}
    assert {"lora_unet_transformer_blocks_59_attn_to_out_0", "lora_unet_transformer_blocks_0_txt_mlp_net_2",
            "lora_unet_transformer_blocks_0_attn_add_q_proj"} <= set(names)
    assert lora_names.dotted("transformer_blocks_59_attn_to_out_0") == "transformer_blocks.59.attn.to_out.0"
    assert all(lora_names.dotted(n[len("lora_unet_"):]) in dict(c.denoiser.named_modules()) for n in with_mod)
    assert family.block_classes == ("QwenImageTransformerBlock",)
    with pytest.raises(ConfigError, match=r"^--network_args exclude_mod: expected True or False"):
        _names(c, exclude_mod="maybe")


def test_tiny_lora_names_and_foreign_layouts_read_back(tmp_path, tiny_qi):
    """24 modules on the tiny model (2 blocks x 12); the same LoRA in ComfyUI's diffusion_model.* names and in
    ai-toolkit's PEFT names (lora_A / lora_B, no alpha: scale 1) reads back as the kohya file."""
    family = get_family("qwen_image")
    assert len(_names(tiny_qi)) == 24
    original = load_file(random_lora_file(family, tiny_qi, str(tmp_path / "lora.safetensors")))
    assert len(original) == 24 * 3 and family.convert_lora_state_dict(original).keys() == original.keys()
    comfy = lora_names.to_comfy_lora(original)
    assert "diffusion_model.transformer_blocks.1.attn.to_out.0.lora_down.weight" in comfy
    back = family.convert_lora_state_dict(comfy)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    peft = {}
    for key, value in original.items():
        name, _, rest = key.partition(".")
        path = "diffusion_model." + lora_names.dotted(name[len("lora_unet_"):])
        alpha = float(original[f"{name}.alpha"])
        rank = original[f"{name}.lora_down.weight"].shape[0]
        if rest == "lora_down.weight":
            peft[f"{path}.lora_A.weight"] = value
        elif rest == "lora_up.weight":
            peft[f"{path}.lora_B.weight"] = value * (alpha / rank)  # the scale moved into B
    back = family.convert_lora_state_dict(peft)
    assert back.keys() == original.keys()
    up = "lora_unet_transformer_blocks_0_attn_to_q"
    torch.testing.assert_close(back[f"{up}.lora_up.weight"] @ back[f"{up}.lora_down.weight"] *
                               (float(back[f"{up}.alpha"]) / 4),
                               original[f"{up}.lora_up.weight"] @ original[f"{up}.lora_down.weight"] *
                               (float(original[f"{up}.alpha"]) / 4), rtol=1e-6, atol=1e-7)


def test_tiny_lora_training_run_with_caches_samples_and_network_weights(tmp_path):
    """2 steps through the family with musubi-tuner's defaults (shift sampling, shift 2.2), text-encoder and latent
    caches on disk and a sample image; the saved file is in kohya names and its ComfyUI rename trains on as
    --network_weights."""
    import numpy as np

    data = make_dataset(str(tmp_path), n=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube --n blurry --w 32 --h 32 --s 2 --l 3.0 --d 5\n")
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:qwen_image", steps=2, extra=[
        "--network_module", "networks.lora_qwen_image", "--cache_text_encoder_outputs_to_disk",
        "--cache_latents_to_disk", "--network_train_unet_only", "--sample_prompts", str(prompts),
        "--sample_every_n_steps", "2"]), "qwen_image")
    path = trainer.run()
    folder = os.path.join(data, "5_sks toy")
    with np.load(os.path.join(folder, "img0_qi_te.npz")) as te:
        assert te["prompt_embeds"].shape == (1024, 32) and te["prompt_mask"].shape == (1024,)
    assert any(n.endswith("_qi.npz") for n in os.listdir(folder))
    samples = os.listdir(tmp_path / "out" / "sample")
    assert any(re.match(r"lora_000002_00_\d+_5\.png$", n) for n in samples), samples
    with safe_open(path, "pt") as f:
        keys = sorted(f.keys())
        metadata = f.metadata()
        up = f.get_tensor("lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight")
    assert len(keys) == 24 * 3 and all(k.startswith("lora_unet_transformer_blocks_") for k in keys)
    assert up.abs().sum() > 0
    assert (metadata["ss_network_module"], metadata["ss_timestep_sampling"], metadata["ss_discrete_flow_shift"]) \
        == ("networks.lora_qwen_image", "shift", "2.2")
    comfy = str(tmp_path / "comfy.safetensors")
    save_file(lora_names.to_comfy_lora(load_file(path)), comfy)
    # --vae: ComfyUI's qwen_image_vae.safetensors (Wan 2.1 names)
    wan_vae = write_qwen_image_preset("tiny:qwen_image", str(tmp_path / "files"), True)["vae"]
    with safe_open(wan_vae, "pt") as f:
        assert "encoder.downsamples.0.residual.0.gamma" in set(f.keys())
    again = make_trainer(base_args(data, str(tmp_path / "out2"), "tiny:qwen_image", steps=1, extra=[
        "--network_module", "networks.lora_qwen_image", "--network_weights", comfy, "--cache_latents",
        "--network_train_unet_only", "--vae", wan_vae]), "qwen_image").run()
    with safe_open(again, "pt") as f:
        assert sorted(f.keys()) == keys
        assert (f.metadata()["ss_base_model_version"], f.metadata()["modelspec.architecture"]) == \
            ("qwen_image", "Qwen-Image/lora")


def test_full_fine_tune_saves_a_single_file_read_back(tmp_path, tiny_qi):
    """qwen_image_train.py's run (fine_tune=True) saves one DiT file in ComfyUI's names that the single-file loader
    reads back, with trained weights."""
    from library.cli.entry import run_training

    family = get_family("qwen_image")
    data = make_dataset(str(tmp_path), n=1)
    argv = [a for a in base_args(data, str(tmp_path / "out"), "tiny:qwen_image", steps=1)
            if a not in ("--network_module", "networks.lora", "--network_dim", "4", "--network_alpha")]
    code = run_training("qwen_image", "test", argv + ["--save_model_as", "safetensors"], fine_tune=True)
    assert code == 0
    saved = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    assert len(saved) == 1
    single = write_qwen_image_preset("tiny:qwen_image", str(tmp_path / "parts"), True)
    c = family.load(LoadOptions(str(tmp_path / "out" / saved[0]), vae=single["vae"],
                                family_options=QwenImageOptions(text_encoder=single["text_encoder"])))
    trained = c.denoiser.state_dict()
    base = tiny_qi.denoiser.state_dict()
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # trained and read back


def test_bad_inputs_are_one_line(written, tmp_path):
    family = get_family("qwen_image")
    single, _ = written
    with pytest.raises(ModelLoadError, match=r"^--text_encoder: required with a Qwen-Image DiT file"):
        family.load(LoadOptions(single["dit"], vae=single["vae"]))
    with pytest.raises(ModelLoadError, match=r"^--pretrained_model_name_or_path .*qwen_2\.5_vl_7b\.safetensors"):
        family.load(LoadOptions(single["text_encoder"], vae=single["vae"],
                                family_options=QwenImageOptions(text_encoder=single["text_encoder"])))
    with pytest.raises(ModelLoadError, match=r"^--vae \S+qwen_2\.5_vl_7b\.safetensors: expected the Qwen-Image VAE in "
                                             r"Wan 2\.1 / ComfyUI names \(qwen_image_vae\.safetensors.* or diffusers' "
                                             r"names .*, found "):
        family.load(LoadOptions(single["dit"], vae=single["text_encoder"],
                                family_options=QwenImageOptions(text_encoder=single["text_encoder"])))


def test_web_ui_template_uses_the_scripts_flags():
    """webui/templates/qwen_image_lora.toml: runs qwen_image_train_network.py, every config key is a flag of that
    script, with musubi-tuner's documented values."""
    from library.cli.entry import build_parser
    from webui.families import script_for
    from webui.jobfiles import templates

    template = templates()["qwen_image_lora"]
    assert (template["template"]["family"], template["template"]["mode"]) == ("qwen_image", "lora")
    assert script_for("qwen_image", "lora") == "qwen_image_train_network.py"
    parser = build_parser("test", get_family("qwen_image"))
    dests = {a.dest for a in parser._actions}
    keys = {k: v for section in template["config"].values() for k, v in section.items()}
    assert sorted(set(keys) - dests) == []
    assert (keys["network_module"], keys["timestep_sampling"], keys["discrete_flow_shift"]) == \
        ("networks.lora_qwen_image", "shift", 2.2)


def _generate(tmp_path, name: str, argv: list[str]):
    import numpy as np
    from PIL import Image

    from tools import generate as tool

    args = tool.build_parser().parse_args(argv + ["--outdir", str(tmp_path / name), "--prompt", "a red cube --d 5",
                                                  "--W", "32", "--H", "48", "--steps", "3", "--device", "cpu"])
    o = tool.options_from_args(args)
    assert o.family == "qwen_image"  # told by the DiT file's keys
    (path,) = tool.run(o)
    image = np.asarray(Image.open(path).convert("RGB")).astype(int)
    assert image.shape == (48, 32, 3)
    return image


def test_generate_with_a_lora_equals_the_merged_file(tmp_path, written, tiny_qi):
    """tools/generate.py on ComfyUI's split files with a LoRA (ComfyUI-named, read back as kohya) makes the same
    image as the merge_lora'd DiT file, and a different one from the plain DiT."""
    import numpy as np

    from tools import merge_lora

    single, _ = written
    family = get_family("qwen_image")
    kohya = load_file(random_lora_file(family, tiny_qi, str(tmp_path / "lora.safetensors"), seed=5))
    # 20x the random ups: the tiny random VAE flattens small latent changes to a pixel or two
    kohya = {k: v * 20 if k.endswith("lora_up.weight") else v for k, v in kohya.items()}
    save_file(kohya, str(tmp_path / "lora.safetensors"))
    lora = str(tmp_path / "comfy_lora.safetensors")
    save_file(lora_names.to_comfy_lora(kohya), lora)
    parts = ["--text_encoder", single["text_encoder"], "--vae", single["vae"]]
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", single["dit"], "--text_encoder", single["text_encoder"],
                            "--models", str(tmp_path / "lora.safetensors"), "--ratios", "1.0",
                            "--save_to", merged]) == 0
    plain = _generate(tmp_path, "plain", ["--ckpt", single["dit"], *parts])
    applied = _generate(tmp_path, "applied", ["--ckpt", single["dit"], *parts, "--network_module",
                                              "networks.lora_qwen_image", "--network_weights", lora])
    from_merged = _generate(tmp_path, "merged", ["--ckpt", merged, *parts])
    assert plain.std() > 0 and np.abs(applied - plain).max() > 8  # the LoRA changes the image
    assert np.abs(applied - from_merged).max() <= 1  # applied at run time = merged into the file


def test_denoising_matches_the_diffusers_pipeline(written):
    """3 Euler steps of QwenImagePipeline (no CFG, output_type latent) from the same noise equal ours: family.predict
    (packing, t = σ, trimmed text) on qwen_image_sigmas (the pipeline's dynamic-shift schedule). Measured max
    difference 1.1e-6 on latents up to 3.6 (float32, the scheduler's own step arithmetic); t = σ·1000/999 instead
    of σ gives 1.3e-2, so atol 1e-5 separates them."""
    from diffusers import QwenImagePipeline

    from library.families.qwen_image.family import pack, unpack
    from library.families.qwen_image.generate import qwen_image_sigmas

    family = get_family("qwen_image")
    _, folder = written
    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.prompt_template_encode_start_idx = template_tokens(pipe.tokenizer)
    c = family.load(LoadOptions(folder))
    h, w = 4, 6  # latents of a 32x48 image
    noise = torch.randn(1, 16, h, w, generator=torch.Generator().manual_seed(3))
    theirs = pipe(prompt="a red cube", height=32, width=48, num_inference_steps=3, true_cfg_scale=1.0,
                  latents=pack(noise), output_type="latent").images
    text = family.encode_text(c, family.tokenize(c, ["a red cube"], None), None)
    sigmas = qwen_image_sigmas(3, (h // 2) * (w // 2))
    torch.testing.assert_close(sigmas, torch.cat([pipe.scheduler.sigmas[:-1].float(), torch.zeros(1)]))
    latents = noise
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            v = family.predict(c, latents, torch.tensor([sigma * 1000]), text, {})
            latents = latents + (sigma_next - sigma) * v
    torch.testing.assert_close(unpack(theirs, h, w), latents, rtol=0, atol=1e-5)
