"""Edit / reference-image training: control_directory datasets, FLUX.1 Kontext (issue 25)."""

import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image

from library.core.errors import DataError
from library.data.control_images import find_controls
from library.families.flux import family as flux_family
from tests.train_helpers import (assert_close_measured, assert_generation_follows_the_reference, dataset_config_args,
                                 make_trainer)


def make_edit_dataset(root: str, n: int = 2, controls: int = 1) -> str:
    """`root/edit.toml`: a subset of n target images (64x64) and .txt captions in root/target, their control
    images (96x64, another size than the target) in root/control; returns the TOML's path."""
    target, control = os.path.join(root, "target"), os.path.join(root, "control")
    os.makedirs(target, exist_ok=True)
    os.makedirs(control, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(os.path.join(target, f"img{i}.png"))
        with open(os.path.join(target, f"img{i}.txt"), "w") as f:
            f.write(f"make it red {i}")
        names = [f"img{i}.png"] if controls == 1 else [f"img{i}_{k}.png" for k in range(controls)]
        for name in names:
            Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(os.path.join(control, name))
    toml = os.path.join(root, "edit.toml")
    with open(toml, "w") as f:
        f.write(f'[general]\ncaption_extension = ".txt"\n[[datasets]]\nresolution = 64\nbatch_size = 1\n'
                f'[[datasets.subsets]]\nimage_dir = "{target}"\ncontrol_directory = "{control}"\nnum_repeats = 1\n')
    return toml


def kontext_args(toml: str, out: str, steps: int = 2, extra=()) -> list[str]:
    return dataset_config_args(toml, out, "tiny:flux_kontext", steps, [
        "--model_type", "kontext", "--t5xxl_max_token_length", "16", "--network_module", "networks.lora_flux",
        "--guidance_scale", "1.0", *extra])


def test_find_controls_one_or_numbered(tmp_path):
    for name in ("a.png", "b_0.png", "b_1.jpg", "b_3.png", "c_1.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    d = str(tmp_path)
    assert find_controls("/x/a.webp", d) == (os.path.join(d, "a.png"),)
    assert find_controls("/x/b.png", d) == (os.path.join(d, "b_0.png"), os.path.join(d, "b_1.jpg"))  # stops at a gap
    assert find_controls("/x/c.png", d) == ()  # numbering starts at 0


def test_kontext_trains_a_lora_with_the_control_tokens(tmp_path, monkeypatch):
    from safetensors import safe_open

    seen = []
    original = flux_family.kontext_tokens

    def spy(latents, controls):
        seen.append([tuple(c.shape) for c in controls])
        return original(latents, controls)

    monkeypatch.setattr(flux_family, "kontext_tokens", spy)
    toml = make_edit_dataset(str(tmp_path))
    path = make_trainer(kontext_args(toml, str(tmp_path / "out")), "flux").run()
    # every training step's call had one control, at the target's latent size (64 px / 8)
    assert seen[:2] == [[(1, 16, 8, 8)], [(1, 16, 8, 8)]]
    with safe_open(path, "pt") as f:
        up = f.get_tensor("lora_unet_double_blocks_1_txt_attn_qkv.lora_up.weight")
        assert f.metadata()["ss_model_type"] == "kontext"
    assert up.abs().sum() > 0


def test_a_missing_control_image_is_named_before_step_1(tmp_path):
    toml = make_edit_dataset(str(tmp_path))
    os.remove(tmp_path / "control" / "img1.png")
    with pytest.raises(DataError) as e:
        make_trainer(kontext_args(toml, str(tmp_path / "out")), "flux").run()
    assert str(e.value) == (f"{tmp_path / 'target' / 'img1.png'}: no control image img1.png (or img1_0.png, "
                            f"img1_1.png, ...) in {tmp_path / 'control'}")
    assert not os.path.exists(tmp_path / "out" / "lora.safetensors")


def test_an_unreadable_control_image_skips_its_target(tmp_path, caplog):
    toml = make_edit_dataset(str(tmp_path), n=3)
    with open(tmp_path / "control" / "img2.png", "wb") as f:
        f.write(b"not a png")
    caplog.set_level(logging.WARNING)
    make_trainer(kontext_args(toml, str(tmp_path / "out"), steps=1), "flux").run()
    assert f"{tmp_path / 'target' / 'img2.png'}: its control image {tmp_path / 'control' / 'img2.png'} cannot be used" \
        in caplog.text


def test_control_images_without_kontext_are_refused(tmp_path):
    toml = make_edit_dataset(str(tmp_path))
    argv = kontext_args(toml, str(tmp_path / "out"))
    argv[argv.index("--model_type") + 1] = "flux"
    with pytest.raises(DataError) as e:
        make_trainer(argv, "flux").run()
    assert str(e.value) == (f"{toml}: datasets[0]: 1 control image(s) per image (control_directory), but this model "
                            "takes none; FLUX.1 takes control images with --model_type kontext")


def test_latent_cache_holds_the_controls_and_a_changed_control_rebuilds_it(tmp_path, caplog):
    toml = make_edit_dataset(str(tmp_path))
    make_trainer(kontext_args(toml, str(tmp_path / "out"), steps=1, extra=["--cache_latents_to_disk"]), "flux").run()
    files = sorted(n for n in os.listdir(tmp_path / "target") if n.endswith(".npz"))
    assert files == ["img0_0064x0064_flux.npz", "img1_0064x0064_flux.npz"]
    with np.load(tmp_path / "target" / files[0]) as f:
        assert sorted(f.files) == ["cache_settings_8x8", "control_latents_0_8x8", "crop_ltrb_8x8", "latents_8x8",
                                   "original_size_8x8"]
        assert f["control_latents_0_8x8"].shape == (16, 8, 8)
        assert not np.array_equal(f["control_latents_0_8x8"], f["latents_8x8"])
    Image.new("RGB", (96, 64), (200, 10, 10)).save(tmp_path / "control" / "img1.png")
    caplog.set_level(logging.INFO)
    make_trainer(kontext_args(toml, str(tmp_path / "out2"), steps=1, extra=["--cache_latents_to_disk"]), "flux").run()
    assert "1 latent cache files are stale" in caplog.text


def test_kontext_step_equals_flux_kontext_pipeline(tiny_flux_copy):
    """One denoising step of diffusers' FluxKontextPipeline on tiny:flux (Kontext [dev] has FLUX.1 dev's weights'
    layout) against the family's predict given the same noisy target, reference latents and text."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    from library.families import get_family
    from library.families.base import TextConditioning
    from library.families.flux.family import unpack_latents
    from library.families.flux.options import FluxOptions

    c = tiny_flux_copy
    pipe = FluxKontextPipeline(FlowMatchEulerDiscreteScheduler(), c.vae, c.text_encoders[0], c.tokenizers[0],
                               c.text_encoders[1], c.tokenizers[1], c.denoiser)
    calls = []

    def record(module, args, kwargs, output):
        calls.append(({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}, output[0].detach().clone()))

    handle = c.denoiser.register_forward_hook(record, with_kwargs=True)
    try:
        reference = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8))
        pipe(image=reference, prompt="make it red", height=64, width=64, num_inference_steps=1,
             guidance_scale=2.5, max_sequence_length=16, output_type="latent", _auto_resize=False, max_area=64 * 64,
             generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    (inputs, expected), = calls
    tokens = inputs["hidden_states"]
    assert tokens.shape[1] == 2 * 16  # the 8x8 target latents and the 8x8 reference's, 2x2-packed
    noisy, control = unpack_latents(tokens[:, :16], 8, 8), unpack_latents(tokens[:, 16:], 8, 8)
    _, ids = flux_family.kontext_tokens(noisy, [control])
    assert torch.equal(ids, inputs["img_ids"])  # first id 1 for the reference tokens, as the pipeline's
    family = get_family("flux")
    c.options = FluxOptions(model_type="kontext", t5xxl_max_token_length=16)
    text = TextConditioning({"t5_out": inputs["encoder_hidden_states"], "l_pooled": inputs["pooled_projections"],
                             "txt_ids": inputs["txt_ids"][None]})
    ours = family.predict(c, noisy, inputs["timestep"] * 1000, text,
                          {"guidance": inputs["guidance"], "scaled_control_latents": [control]})
    # measured 0 (the same ops in the same order on the same tensors); the tolerance allows another kernel order
    assert_close_measured(ours, unpack_latents(expected[:, :16], 8, 8), 1e-5, "Kontext step vs FluxKontextPipeline")


def test_generate_makes_an_image_with_a_kontext_lora_and_control_image(tmp_path):
    from tools import generate as tool

    toml = make_edit_dataset(str(tmp_path))
    lora = make_trainer(kontext_args(toml, str(tmp_path / "out")), "flux").run()
    reference, other = str(tmp_path / "control" / "img0.png"), str(tmp_path / "control" / "img1.png")
    assert_generation_follows_the_reference(tmp_path, ["--ckpt", "tiny:flux_kontext", "--flux"], "networks.lora_flux",
                                            lora, reference, other)
    from library.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--control_image / --ci: sd models take no control images \(edit models "
                                          r"do: FLUX.1 Kontext\)$"):
        tool.run(tool.options_from_args(tool.build_parser().parse_args(
            ["--ckpt", "tiny:sd1", "--outdir", str(tmp_path / "sd"), "--prompt", "x", "--control_image", reference])))
    with pytest.raises(ConfigError, match=r"^--control_image /nowhere.png: file not found$"):
        tool.options_from_args(tool.build_parser().parse_args(
            ["--ckpt", "tiny:flux_kontext", "--outdir", str(tmp_path), "--prompt", "x", "--control_image",
             "/nowhere.png"]))


def test_prompt_files_take_control_images(tmp_path):
    from library.core.errors import ConfigError
    from library.sampling.prompts import load_prompts, parse_prompt_line

    a, b = tmp_path / "a.png", tmp_path / "b.png"
    Image.new("RGB", (8, 8)).save(a)
    Image.new("RGB", (8, 8)).save(b)
    assert parse_prompt_line(f"make it red --ci {a} --ci {b} --w 64", "p.txt:1").control_images == (str(a), str(b))
    with pytest.raises(ConfigError, match=r"^p.txt:2: --ci /nowhere.png: file not found$"):
        parse_prompt_line("x --ci /nowhere.png", "p.txt:2")
    toml = tmp_path / "p.toml"
    toml.write_text(f'[prompt]\n[[prompt.subset]]\nprompt = "x"\ncontrol_image = ["{a}"]\n'
                    f'[[prompt.subset]]\nprompt = "y"\ncontrol_image = "{b}"\n')
    assert [p.control_images for p in load_prompts(str(toml))] == [(str(a),), (str(b),)]


def test_flux_train_kontext_full_fine_tune_saves_a_file_the_loader_reads(tmp_path):
    from library.families import get_family
    from library.families.base import LoadOptions
    from library.families.flux.options import FluxOptions
    from tests.train_helpers import ft_trainer

    toml = make_edit_dataset(str(tmp_path))
    argv = kontext_args(toml, str(tmp_path / "out"), extra=["--optimizer_type", "SGDNesterov"])
    for flag in ("--network_module", "--network_module", "--network_dim", "--network_alpha"):
        i = argv.index(flag)
        del argv[i:i + 2]
    argv[argv.index("--output_name") + 1] = "model"
    path = ft_trainer(argv, "flux").run()
    parts = get_family("flux").write_preset("tiny:flux_kontext", str(tmp_path / "parts"), single_file=True)
    loaded = get_family("flux").load(LoadOptions(path, family_options=FluxOptions(
        model_type="kontext", clip_l=parts["clip_l"], t5xxl=parts["t5xxl"], ae=parts["ae"])))
    base = get_family("flux").load(LoadOptions(parts["transformer"], family_options=FluxOptions(
        model_type="kontext", clip_l=parts["clip_l"], t5xxl=parts["t5xxl"], ae=parts["ae"])))
    trained, before = loaded.denoiser.state_dict(), base.denoiser.state_dict()
    assert trained.keys() == before.keys()
    assert any(not torch.equal(trained[k], before[k]) for k in trained)  # the fine-tune changed the weights


def test_kontext_template_trains_with_the_tiny_model(tmp_path):
    """webui/templates/flux_kontext_lora.toml: its settings (model files swapped for the tiny preset, the example
    folders for an edit dataset) train 1 step through flux_train_network.py's entry."""
    import toml as toml_lib

    from library.cli.entry import run_training

    template = toml_lib.load(os.path.join(os.path.dirname(__file__), "..", "webui", "templates",
                                          "flux_kontext_lora.toml"))
    assert template["config"]["model"]["model_type"] == "kontext"
    make_edit_dataset(str(tmp_path))
    dataset = template["dataset"]
    subset = dataset["datasets"][0]["subsets"][0]
    assert set(subset) == {"image_dir", "control_directory", "num_repeats"}
    subset.update(image_dir=str(tmp_path / "target"), control_directory=str(tmp_path / "control"))
    dataset["datasets"][0].update(resolution=64, min_bucket_reso=64, max_bucket_reso=128)
    with open(tmp_path / "dataset.toml", "w") as f:
        toml_lib.dump(dataset, f)
    config = template["config"]
    config["model"] = {"model_type": "kontext", "pretrained_model_name_or_path": "tiny:flux_kontext",
                       "guidance_scale": config["model"]["guidance_scale"], "t5xxl_max_token_length": 16}
    config["optimizer"]["optimizer_type"] = "AdamW"
    config["training"].update(max_train_steps=1, mixed_precision="no", dataset_config=str(tmp_path / "dataset.toml"),
                              output_dir=str(tmp_path / "out"), max_data_loader_n_workers=0)
    config["output"]["log_with"] = None
    config["output"] = {k: v for k, v in config["output"].items() if v is not None}
    with open(tmp_path / "config.toml", "w") as f:
        toml_lib.dump(config, f)
    assert run_training("flux", "test", ["--config_file", str(tmp_path / "config.toml")]) == 0
    assert os.path.isfile(tmp_path / "out" / "my_kontext_lora.safetensors")


# --- tools/convert_lora.py: Z-Image is not Lumina, Qwen-Image --to diffusers (issue 25's leftovers) -------------

def _random_lora(family_name: str, preset: str, path: str, metadata: dict) -> str:
    from safetensors.torch import load_file, save_file

    from library.families import get_family
    from library.families.base import LoadOptions
    from tests.train_helpers import random_lora_file

    family = get_family(family_name)
    random_lora_file(family, family.load(LoadOptions(preset)), path)
    save_file(load_file(path), path, metadata)
    return path


def _convert(src: str, dst: str, to: str, *extra) -> dict:
    from safetensors.torch import load_file

    from tools import convert_lora

    convert_lora.run(["--src_path", src, "--dst_path", dst, "--to", to, *extra])
    return load_file(dst)


def _adapted_layers(pipeline_class, family_name: str, preset: str, path: str, caplog) -> list[str]:
    """The transformer modules a diffusers pipeline's load_lora_weights puts the file's LoRA on; fails on any
    warning diffusers logs while loading (unexpected or missing keys)."""
    from library.families import get_family
    from library.families.base import LoadOptions
    from tests.train_helpers import diffusers_loading_warnings

    transformer = get_family(family_name).load(LoadOptions(preset)).denoiser
    diffusers_logger = logging.getLogger("diffusers")
    diffusers_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="diffusers"):
            pipeline_class.load_lora_into_transformer(pipeline_class.lora_state_dict(path), transformer=transformer,
                                                      adapter_name="x")
    finally:
        diffusers_logger.removeHandler(caplog.handler)
    assert not diffusers_loading_warnings(caplog.records), caplog.text
    return sorted(n for n, m in transformer.named_modules() if "x" in getattr(m, "lora_A", {}))


def test_convert_lora_tells_zimage_from_lumina_and_writes_zimage_diffusers_keys(tmp_path, caplog):
    from diffusers import ZImagePipeline
    from safetensors.torch import load_file

    src = _random_lora("zimage", "tiny:zimage", str(tmp_path / "zi.safetensors"), {"ss_base_model_version": "zimage"})
    kohya = load_file(src)
    comfy = _convert(src, str(tmp_path / "comfy.safetensors"), "comfy")
    assert comfy.keys() == kohya.keys()  # Qwen3's lora_te_ names stay; no Lumina gemma2_2b names
    peft = _convert(src, str(tmp_path / "peft.safetensors"), "diffusers")
    assert sorted(k for k in peft if k.startswith("transformer.layers.0."))[:4] == [
        "transformer.layers.0.attention.to_k.lora_A.weight", "transformer.layers.0.attention.to_k.lora_B.weight",
        "transformer.layers.0.attention.to_out.0.lora_A.weight", "transformer.layers.0.attention.to_out.0.lora_B.weight"]
    # ΔW of the fused qkv's k rows: B_k A_k equals the kohya delta's middle third (alpha baked in)
    name = "lora_unet_layers_1_attention_qkv"
    delta = kohya[f"{name}.lora_up.weight"] @ kohya[f"{name}.lora_down.weight"] \
        * (kohya[f"{name}.alpha"] / kohya[f"{name}.lora_down.weight"].shape[0])
    k_rows = delta.chunk(3)[1]
    got = peft["transformer.layers.1.attention.to_k.lora_B.weight"] @ peft["transformer.layers.1.attention.to_k.lora_A.weight"]
    assert_close_measured(got, k_rows, 1e-6, "Z-Image k delta (diffusers vs kohya)")  # measured 0 (the same products)
    layers = _adapted_layers(ZImagePipeline, "zimage", "tiny:zimage", str(tmp_path / "peft.safetensors"), caplog)
    assert len(layers) == 14 and layers[:3] == ["layers.0.attention.to_k", "layers.0.attention.to_out.0",
                                                "layers.0.attention.to_q"]
    # a file without metadata: --family zimage says what the names cannot
    bare = _random_lora("zimage", "tiny:zimage", str(tmp_path / "bare.safetensors"), {})
    assert _convert(bare, str(tmp_path / "bare_peft.safetensors"), "diffusers", "--family", "zimage").keys() \
        == peft.keys()


def test_convert_lora_qwen_image_to_diffusers_loads_with_no_unexpected_keys(tmp_path, caplog):
    from diffusers import QwenImagePipeline
    from safetensors.torch import load_file

    src = _random_lora("qwen_image", "tiny:qwen_image", str(tmp_path / "qi.safetensors"),
                       {"ss_base_model_version": "qwen_image"})
    kohya = load_file(src)
    peft = _convert(src, str(tmp_path / "peft.safetensors"), "diffusers")
    assert len(peft) == 2 * 24 and all(k.startswith("transformer.transformer_blocks.") for k in peft)
    name = "lora_unet_transformer_blocks_1_attn_add_k_proj"
    delta = kohya[f"{name}.lora_up.weight"] @ kohya[f"{name}.lora_down.weight"] \
        * (kohya[f"{name}.alpha"] / kohya[f"{name}.lora_down.weight"].shape[0])
    got = peft["transformer.transformer_blocks.1.attn.add_k_proj.lora_B.weight"] \
        @ peft["transformer.transformer_blocks.1.attn.add_k_proj.lora_A.weight"]
    assert_close_measured(got, delta, 1e-6, "Qwen-Image delta (diffusers vs kohya)")  # measured 0 (the same products)
    layers = _adapted_layers(QwenImagePipeline, "qwen_image", "tiny:qwen_image", str(tmp_path / "peft.safetensors"),
                             caplog)
    assert len(layers) == 24 and layers[0] == "transformer_blocks.0.attn.add_k_proj"


def test_webui_checks_control_directory_like_the_other_dataset_folders(tmp_path):
    """The web UI keeps every dataset path inside its roots and names missing folders: control_directory too."""
    from webui.folders import dataset_paths, missing_dataset_folders

    dataset = {"datasets": [{"subsets": [{"image_dir": str(tmp_path), "control_directory": "/nowhere/controls"}]}]}
    assert dataset_paths(dataset) == [("image_dir", str(tmp_path)), ("control_directory", "/nowhere/controls")]
    assert missing_dataset_folders(dataset) == [("control_directory", "/nowhere/controls", "datasets[0].subsets[0]")]


def test_sampling_during_kontext_training_uses_the_prompts_control_image(tmp_path):
    import glob

    toml = make_edit_dataset(str(tmp_path))
    prompts = tmp_path / "prompts.txt"
    # the same prompt and seed with two different control images: the samples differ only by the reference
    prompts.write_text(f"make it red --w 64 --h 64 --s 2 --d 5 --ci {tmp_path / 'control' / 'img0.png'}\n"
                       f"make it red --w 64 --h 64 --s 2 --d 5 --ci {tmp_path / 'control' / 'img1.png'}\n")
    make_trainer(kontext_args(toml, str(tmp_path / "out"), steps=1, extra=[
        "--sample_prompts", str(prompts), "--sample_at_first"]), "flux").run()
    paths = sorted(glob.glob(str(tmp_path / "out" / "sample" / "lora_e000000_0*.png")))
    assert len(paths) == 2
    first, second = (np.asarray(Image.open(p).convert("RGB")) for p in paths)
    assert first.shape == (64, 64, 3) and not np.array_equal(first, second)


def test_latent_cache_with_flip_aug_holds_the_flipped_controls(tmp_path):
    toml = make_edit_dataset(str(tmp_path))
    with open(toml) as f:
        text = f.read()
    with open(toml, "w") as f:
        f.write(text.replace("num_repeats = 1\n", "num_repeats = 1\nflip_aug = true\n"))
    make_trainer(kontext_args(toml, str(tmp_path / "out"), steps=2, extra=["--cache_latents_to_disk"]), "flux").run()
    with np.load(tmp_path / "target" / "img0_0064x0064_flux.npz") as f:
        assert {"control_latents_0_8x8", "control_latents_flipped_0_8x8", "latents_flipped_8x8"} <= set(f.files)
        assert not np.array_equal(f["control_latents_0_8x8"], f["control_latents_flipped_0_8x8"])


def test_qwen_image_step_with_reference_latents_equals_qwen_image_edit_plus_pipeline(tmp_path):
    """The DiT side of Qwen-Image-Edit: given the pipeline's own text embeddings (the Qwen2.5-VL encoding with the
    image input is not done yet), one denoising step of QwenImageEditPlusPipeline equals the family's predict with
    the reference latents (a 64x48 reference, which the pipeline resizes to about 1024² pixels, beside a 64x64
    target: its own img_shapes entry)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

    from library.families import get_family
    from library.families.base import LoadOptions, TextConditioning
    from library.families.qwen_image.family import unpack

    family = get_family("qwen_image")
    c = family.load(LoadOptions("tiny:qwen_image"))
    pipe = QwenImageEditPlusPipeline(FlowMatchEulerDiscreteScheduler(), c.vae, None, None, None, c.denoiser)
    calls = []
    handle = c.denoiser.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out[0].detach().clone())), with_kwargs=True)
    embeds = torch.randn(1, 7, c.denoiser.config.joint_attention_dim, generator=torch.Generator().manual_seed(3))
    try:
        reference = Image.fromarray(np.random.default_rng(2).integers(0, 255, (48, 64, 3), dtype=np.uint8))
        pipe(image=[reference], prompt_embeds=embeds, prompt_embeds_mask=torch.ones(1, 7, dtype=torch.long),
             height=64, width=64, num_inference_steps=1, output_type="latent", true_cfg_scale=1.0,
             generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    (inputs, expected), = calls
    shapes = inputs["img_shapes"][0]
    assert shapes == [(1, 4, 4), (1, 56, 74)]  # the 64x48 reference resized by calculate_dimensions: 1184x896
    tokens, (_, rh, rw) = inputs["hidden_states"], shapes[1]
    noisy, control = unpack(tokens[:, :16], 8, 8), unpack(tokens[:, 16:], 2 * rh, 2 * rw)
    assert torch.equal(inputs["encoder_hidden_states"], embeds)
    # the pipeline drops an all-ones mask (passes None); the family's text always carries one
    text = TextConditioning({"prompt_embeds": embeds, "prompt_mask": torch.ones(1, 7, dtype=torch.long)})
    ours = family.predict(c, noisy, inputs["timestep"] * 1000, text, {"scaled_control_latents": [control]})
    # measured 0 (the same ops in the same order on the same tensors)
    assert_close_measured(ours, unpack(expected[:, :16], 8, 8), 1e-5, "Qwen-Image step with a reference vs the pipeline")
