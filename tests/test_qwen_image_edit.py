"""Qwen-Image-Edit (Edit, Edit-2509, Edit-2511): tiny:qwen_image_edit written as a diffusers folder (text_encoder =
Qwen2_5_VLForConditionalGeneration with a tiny vision tower, processor/) and as ComfyUI's split files and read back;
the caption + control images encoded as diffusers' QwenImageEditPlusPipeline / QwenImageEditPipeline encode_prompt
does; one denoising step equal to the pipeline's; LoRA training from control_directory datasets (1 and 2 controls)
with the text cache keyed on the control images; a full fine-tune read back; generation with --control_image."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from library.core.errors import ConfigError, DataError
from library.families import get_family
from library.families.base import LoadOptions
from library.families.qwen_image.loading import write_qwen_image_preset
from library.families.qwen_image.options import QwenImageOptions
from library.families.qwen_image.text import edit_template_tokens, vl_image
from tests.test_edit_training import make_edit_dataset
from tests.train_helpers import dataset_config_args, make_trainer

PRESET = "tiny:qwen_image_edit"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-edit-files")
    single = write_qwen_image_preset(PRESET, str(root / "comfy"), True)
    folder = write_qwen_image_preset(PRESET, str(root / "diffusers"), False)["folder"]
    rng = np.random.default_rng(0)
    controls = []
    for i, (w, h) in enumerate(((96, 64), (48, 80))):
        controls.append(str(root / f"control{i}.png"))
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(controls[-1])
    return single, folder, controls


@pytest.fixture(scope="module")
def tiny_edit():
    options = QwenImageOptions(model_version="edit-2509")
    return get_family("qwen_image").load(LoadOptions(PRESET, family_options=options))


def _text(family, c, caption, controls):
    return family.encode_text(c, family.tokenize(c, [family.text_key(c, caption, tuple(controls))], None), None)


def _pipeline(folder: str, cls_name: str = "QwenImageEditPlusPipeline"):
    """The diffusers pipeline on the written folder (built from its parts: Qwen2VLProcessor wants torchvision for
    its video processor, so the processor is assembled as our loader does)."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from library.families.common.qwen_vl import vl_processor

    processor = vl_processor(AutoTokenizer.from_pretrained(os.path.join(folder, "processor")),
                             Qwen2VLImageProcessor.from_pretrained(os.path.join(folder, "processor")))
    pipe = getattr(diffusers, cls_name)(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(folder, subfolder="vae"),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, subfolder="text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(folder, subfolder="tokenizer"), processor=processor,
        transformer=QwenImageTransformer2DModel.from_pretrained(folder, subfolder="transformer"))
    pipe.prompt_template_encode_start_idx = edit_template_tokens(processor.tokenizer)  # 64 with Qwen's tokenizer
    return pipe


def test_tiny_edit_files_load_back_through_the_real_loaders(files, tiny_edit):
    """The diffusers folder (model_index QwenImageEditPlusPipeline, processor/, the whole Qwen2.5-VL) and ComfyUI's
    split files (qwen_2.5_vl_7b.safetensors with visual.*) give the preset's text encoding with images bitwise."""
    family = get_family("qwen_image")
    single, folder, controls = files
    assert sorted(os.listdir(folder)) == ["model_index.json", "processor", "scheduler", "text_encoder", "tokenizer",
                                          "transformer", "vae"]
    with safe_open(single["text_encoder"], "pt") as f:
        keys = set(f.keys())
    assert "visual.patch_embed.proj.weight" in keys and "model.embed_tokens.weight" in keys
    expected = _text(family, tiny_edit, "make it red", controls)
    opts = QwenImageOptions(model_version="edit-2509")
    from_folder = family.load(LoadOptions(folder, family_options=opts))
    assert torch.equal(_text(family, from_folder, "make it red", controls).tensors["prompt_embeds"],
                       expected.tensors["prompt_embeds"])
    split = family.load(LoadOptions(single["dit"], vae=single["vae"], family_options=QwenImageOptions(
        model_version="edit-2509", text_encoder=single["text_encoder"])))
    assert torch.equal(_text(family, split, "make it red", controls).tensors["prompt_embeds"],
                       expected.tensors["prompt_embeds"])
    # the images matter: another image, or none, is another encoding
    other = _text(family, tiny_edit, "make it red", controls[1:]).tensors["prompt_embeds"]
    assert not torch.equal(other, expected.tensors["prompt_embeds"])


@pytest.mark.parametrize("version,count", [("edit-2509", 1), ("edit-2509", 2), ("edit", 1)])
def test_text_equals_the_pipelines_encode_prompt(files, version, count):
    """Our caption + control images encoding equals the pipeline's encode_prompt given the same condition images
    (Picture N template for 2509 / 2511, Edit's own template), bitwise: the same processor call and Qwen2.5-VL ops;
    the condition image resize (vl_image) is the pipeline's __call__ rule, checked in the one-step test."""
    family = get_family("qwen_image")
    _, folder, controls = files
    pipe = _pipeline(folder, "QwenImageEditPipeline" if version == "edit" else "QwenImageEditPlusPipeline")
    c = family.load(LoadOptions(folder, family_options=QwenImageOptions(model_version=version)))
    images = [vl_image(p, version) for p in controls[:count]]
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt("make it red", image=images if version != "edit" else images[0],
                                          device="cpu")
        ours = _text(family, c, "make it red", controls[:count]).tensors
    n = embeds.shape[1]
    assert mask is None and int(ours["prompt_mask"].sum()) == n  # one prompt: the pipeline drops an all-ones mask
    assert torch.equal(ours["prompt_embeds"][:, :n], embeds)
    assert not ours["prompt_embeds"][:, n:].any()


@pytest.mark.parametrize("version,count", [("edit-2509", 2), ("edit-2511", 1), ("edit", 1)])
def test_denoising_steps_equal_the_pipeline(files, version, count):
    """Two steps of the pipeline (no CFG, output_type latent; one step is NaN in its scheduler with shift_terminal,
    in ours too) from the same noise, given the control images as
    files, equals ours: text with the images (vl_image: ~384² / Edit ~1024²), each control through the VAE at
    ~1024² of its own aspect (posterior mode), packed after the noise (family.predict), 2511's zero_cond_t.
    Measured max difference 2.4e-7 on latents up to 3.5 in all three (the scheduler's own step arithmetic); 2511's
    zero_cond_t changes the tiny DiT's velocity by 1.2e-2 (at t = 700), so atol 1e-6 tells them apart."""
    from library.families.qwen_image.family import pack, unpack
    from library.families.qwen_image.generate import encode_edit_controls, qwen_image_sigmas
    from library.families.qwen_image.loading import set_zero_cond_t

    family = get_family("qwen_image")
    _, folder, controls = files
    pipe = _pipeline(folder, "QwenImageEditPipeline" if version == "edit" else "QwenImageEditPlusPipeline")
    if version == "edit-2511":
        set_zero_cond_t(pipe.transformer)  # Qwen-Image-Edit-2511's transformer/config.json says so
    c = family.load(LoadOptions(folder, family_options=QwenImageOptions(model_version=version)))
    assert c.denoiser.zero_cond_t == (version == "edit-2511")
    h, w = 4, 6  # latents of a 32x48 image
    noise = torch.randn(1, 16, h, w, generator=torch.Generator().manual_seed(3))
    images = [Image.open(p).convert("RGB") for p in controls[:count]]
    with torch.no_grad():
        theirs = pipe(image=images if version != "edit" else images[0], prompt="make it red", height=32, width=48,
                      num_inference_steps=2, true_cfg_scale=1.0, latents=pack(noise), output_type="latent").images
        text = _text(family, c, "make it red", controls[:count])
        refs = [family.scale_latents(x) for x in encode_edit_controls(c.vae, controls[:count], torch.device("cpu"))]
        ours = noise
        sigmas = qwen_image_sigmas(2, (h // 2) * (w // 2))
        for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            v = family.predict(c, ours, torch.tensor([sigma * 1000]), text, {"scaled_control_latents": refs})
            ours = ours + (sigma_next - sigma) * v
    # 96x64 -> 1248x832 pixels, 48x80 -> 800x1312 (about 1024², multiples of 32), 8x down
    assert [tuple(r.shape) for r in refs] == [(1, 16, 104, 156), (1, 16, 164, 100)][:count]
    torch.testing.assert_close(unpack(theirs, h, w), ours, rtol=0, atol=1e-6)


def edit_args(toml: str, out: str, version: str = "edit-2509", steps: int = 2, extra=()) -> list[str]:
    return dataset_config_args(toml, out, PRESET, steps=steps, extra=[
        "--model_version", version, "--network_module", "networks.lora_qwen_image", "--network_train_unet_only",
        *extra])


@pytest.mark.parametrize("controls", [1, 2])
def test_lora_trains_from_control_images_with_the_text_cache_keyed_on_them(tmp_path, monkeypatch, caplog, controls):
    """qwen_image_train_network.py's run on a control_directory dataset (1 or 2 controls a target): the DiT gets the
    controls' tokens after the target's, the cached text (on disk) is the encoding with the controls (it equals
    encoding them now), and a changed control image rebuilds its entry; a sample with --ci is drawn."""
    from library.families.qwen_image import family as qi_family

    toml = make_edit_dataset(str(tmp_path), n=2, controls=controls)
    shapes = []
    real = qi_family.pack

    def spy(latents):
        shapes.append(tuple(latents.shape))
        return real(latents)

    monkeypatch.setattr(qi_family, "pack", spy)
    control = tmp_path / "control"
    names = ["img0.png"] if controls == 1 else [f"img0_{k}.png" for k in range(controls)]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("make it red --w 32 --h 32 --s 2 --d 5 " + " ".join(f"--ci {control / n}" for n in names)
                       + "\n")
    path = make_trainer(edit_args(toml, str(tmp_path / "out"), extra=[
        "--cache_text_encoder_outputs_to_disk", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"]),
        "qwen_image").run()
    assert shapes[:1 + controls] == [(1, 16, 8, 8)] + [(1, 16, 8, 8)] * controls  # target, then each control
    assert any(n.endswith(".png") for n in os.listdir(tmp_path / "out" / "sample"))
    with safe_open(path, "pt") as f:
        assert f.get_tensor("lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight").abs().sum() > 0
        metadata = f.metadata()
    assert (metadata["ss_network_module"], metadata["ss_base_model_version"], metadata["modelspec.architecture"]) == \
        ("networks.lora_qwen_image", "qwen_image_edit", "Qwen-Image-Edit-Plus/lora")  # as musubi-tuner's edit-2509
    te = str(tmp_path / "target" / "img0_qi_te.npz")
    with np.load(te) as f:
        cached = torch.from_numpy(f["prompt_embeds"])
    family = get_family("qwen_image")
    c = family.load(LoadOptions(PRESET, family_options=QwenImageOptions(model_version="edit-2509")))
    now = _text(family, c, "make it red 0", [str(control / n) for n in names]).tensors["prompt_embeds"][0]
    assert cached.shape == (2048, 32) and torch.equal(cached, now)
    plain = _text(family, c, "make it red 0", []).tensors["prompt_embeds"][0]
    assert not torch.equal(cached, plain)
    # unchanged: the next run reads both entries back; a changed control image: its entry no longer matches, so the
    # next run encodes it again
    caplog.set_level(logging.INFO, logger="library.data.te_cache")
    again = edit_args(toml, str(tmp_path / "out2"), steps=1, extra=["--cache_text_encoder_outputs_to_disk"])
    make_trainer(again, "qwen_image").run()
    assert "text encoder cache: 2 captions, 0 encoded, 0 files written" in caplog.text
    Image.fromarray(np.zeros((64, 96, 3), np.uint8)).save(control / names[0])
    caplog.clear()
    make_trainer(again, "qwen_image").run()
    assert "text encoder cache: 2 captions, 1 encoded, 1 files written" in caplog.text
    with np.load(te) as f:
        assert not torch.equal(torch.from_numpy(f["prompt_embeds"]), cached)


def test_control_counts_and_files_are_checked_before_step_1(tmp_path):
    """A 4th control image (2509 / 2511 take 3), a 2nd for the original Edit, control images without an edit
    --model_version, and a missing control image are each one line before anything loads."""
    toml = make_edit_dataset(str(tmp_path / "four"), n=1, controls=4)
    with pytest.raises(DataError, match=r"4 control image\(s\) per image \(control_directory\), but this model takes "
                                         r"at most 3"):
        make_trainer(edit_args(toml, str(tmp_path / "out")), "qwen_image").run()
    toml = make_edit_dataset(str(tmp_path / "two"), n=1, controls=2)
    with pytest.raises(DataError, match=r"2 control image\(s\) per image \(control_directory\), but this model takes "
                                         r"at most 1"):
        make_trainer(edit_args(toml, str(tmp_path / "out"), version="edit"), "qwen_image").run()
    with pytest.raises(DataError, match=r"but this model takes none; Qwen-Image takes control images with "
                                         r"--model_version edit, edit-2509 or edit-2511"):
        make_trainer(edit_args(toml, str(tmp_path / "out"), version="original"), "qwen_image").run()
    os.remove(tmp_path / "two" / "control" / "img0_1.png")
    os.remove(tmp_path / "two" / "control" / "img0_0.png")
    with pytest.raises(DataError, match=r"img0.png: no control image img0.png"):
        make_trainer(edit_args(toml, str(tmp_path / "out")), "qwen_image").run()


def test_full_fine_tune_saves_a_single_file_read_back(tmp_path, files, tiny_edit):
    """qwen_image_train.py (fine_tune) on a control dataset saves one DiT file that the single-file loader reads
    back with ComfyUI's Qwen2.5-VL file (vision tower included), with trained weights."""
    from library.cli.entry import run_training

    single, _, _ = files
    toml = make_edit_dataset(str(tmp_path), n=1, controls=2)
    argv = edit_args(toml, str(tmp_path / "out"), steps=1)
    for flag, n in (("--network_module", 1), ("--network_module", 1), ("--network_dim", 1), ("--network_alpha", 1),
                    ("--network_train_unet_only", 0)):
        i = argv.index(flag)
        del argv[i:i + 1 + n]
    assert run_training("qwen_image", "test", argv + ["--save_model_as", "safetensors"], fine_tune=True) == 0
    saved = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    assert len(saved) == 1
    c = get_family("qwen_image").load(LoadOptions(str(tmp_path / "out" / saved[0]), vae=single["vae"],
                                                  family_options=QwenImageOptions(
                                                      model_version="edit-2509", text_encoder=single["text_encoder"])))
    trained, base = c.denoiser.state_dict(), tiny_edit.denoiser.state_dict()
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base)


def test_generate_makes_an_image_with_the_lora_and_control_images(tmp_path, files):
    """tools/generate.py --model_version edit-2509 --control_image A [B] with a LoRA trained on 2 controls: the
    same image again with the same images and seed, another with other control images; a 4th image, or control
    images without an edit --model_version, are refused in one line."""
    from tools import generate as tool

    toml = make_edit_dataset(str(tmp_path), n=2, controls=2)
    lora = make_trainer(edit_args(toml, str(tmp_path / "out")), "qwen_image").run()
    control = tmp_path / "control"
    a, b, c_ = str(control / "img0_0.png"), str(control / "img0_1.png"), str(control / "img1_0.png")

    def generate(outdir, *extra, version="edit-2509"):
        argv = ["--ckpt", PRESET, "--model_version", version, "--outdir", str(tmp_path / outdir), "--prompt",
                "make it red --w 32 --h 48 --s 2 --d 1", "--network_module", "networks.lora_qwen_image",
                "--network_weights", lora, "--device", "cpu", *extra]
        paths = tool.run(tool.options_from_args(tool.build_parser().parse_args(argv)))
        assert len(paths) == 1
        return np.asarray(Image.open(paths[0]).convert("RGB"))

    two = generate("a", "--control_image", a, b)
    assert two.shape == (48, 32, 3)
    assert np.array_equal(two, generate("b", "--control_image", a, b))
    assert not np.array_equal(two, generate("c", "--control_image", a, c_))
    one = generate("d", "--control_image", a)
    assert not np.array_equal(one, two)
    with pytest.raises(ConfigError, match=r"^--control_image: 4 control images; Qwen-Image-Edit \(edit-2509\) takes "
                                          r"at most 3$"):
        generate("e", "--control_image", a, b, c_, a)
    with pytest.raises(ConfigError, match=r"^--control_image: Qwen-Image takes control images with --model_version "
                                          r"edit, edit-2509 or edit-2511"):
        generate("f", "--control_image", a, version="original")


def test_an_unreadable_control_image_skips_its_target_with_the_text_cache(tmp_path, caplog):
    """The dataset's policy holds with the text cache (which reads the control images too): the target is skipped
    with the reason before step 1, the others train."""
    toml = make_edit_dataset(str(tmp_path), n=3)
    with open(tmp_path / "control" / "img2.png", "wb") as f:
        f.write(b"not a png")
    caplog.set_level(logging.WARNING)
    make_trainer(edit_args(toml, str(tmp_path / "out"), steps=1, extra=["--cache_text_encoder_outputs"]),
                 "qwen_image").run()
    assert f"{tmp_path / 'target' / 'img2.png'}: its control image {tmp_path / 'control' / 'img2.png'} cannot be used" \
        in caplog.text


def test_an_edit_run_needs_the_vision_tower(files, tmp_path):
    """--model_version edit* with a text encoder file without visual.* keys, or with tiny:qwen_image (no vision
    tower), is one line at load."""
    from safetensors.torch import load_file, save_file

    from library.families.base import ModelLoadError

    single, _, _ = files
    text_only = str(tmp_path / "qwen_text_only.safetensors")
    save_file({k: v for k, v in load_file(single["text_encoder"]).items() if not k.startswith("visual.")}, text_only)
    family = get_family("qwen_image")
    with pytest.raises(ModelLoadError, match=r"^--text_encoder .*qwen_text_only.safetensors: no vision tower "
                                             r"\(visual\.\* keys\); Qwen-Image-Edit reads the control images with it"):
        family.load(LoadOptions(single["dit"], vae=single["vae"], family_options=QwenImageOptions(
            model_version="edit", text_encoder=text_only)))
    with pytest.raises(ModelLoadError, match=r"^--model_version edit-2511: tiny:qwen_image has no vision tower; use "
                                             r"tiny:qwen_image_edit$"):
        family.load(LoadOptions("tiny:qwen_image", family_options=QwenImageOptions(model_version="edit-2511")))


def test_a_batch_encodes_as_its_samples_alone(files, tiny_edit):
    """Captions of different lengths with 1 or 2 control images of different sizes, encoded together (the processor
    pads to the longest, the images' patches in one tensor) equal each encoded alone within float32 rounding, so the
    text cache's batches change nothing that matters; the masks are equal."""
    family = get_family("qwen_image")
    _, _, controls = files
    keys = [family.text_key(tiny_edit, "make it red", (controls[0],)),
            family.text_key(tiny_edit, "a much longer caption, then blue", (controls[1],)),
            family.text_key(tiny_edit, "x", tuple(controls))]
    with torch.no_grad():
        together = family.encode_text(tiny_edit, family.tokenize(tiny_edit, keys, None), None).tensors
        alone = [family.encode_text(tiny_edit, family.tokenize(tiny_edit, [k], None), None).tensors for k in keys]
    # measured 3.0e-7 on states up to 3.5 (float32 sums over other padded lengths); a wrong image order or a
    # template change moves them by O(1)
    torch.testing.assert_close(together["prompt_embeds"], torch.cat([a["prompt_embeds"] for a in alone]),
                               rtol=0, atol=2e-6)
    assert torch.equal(together["prompt_mask"], torch.cat([a["prompt_mask"] for a in alone]))


@pytest.mark.parametrize("version,base,arch", [
    ("original", "qwen_image", "Qwen-Image"), ("edit", "qwen_image_edit", "Qwen-Image-Edit"),
    ("edit-2509", "qwen_image_edit", "Qwen-Image-Edit-Plus"), ("edit-2511", "qwen_image_edit", "Qwen-Image-Edit-2511")])
def test_metadata_names_the_version_as_musubi_tuner(version, base, arch):
    """ss_base_model_version is musubi-tuner's architecture_full_name (qwen_image / qwen_image_edit: one for every
    edit version); modelspec.architecture its sai_model_spec ARCH_QWEN_IMAGE_EDIT / _EDIT_PLUS / _EDIT_2511."""
    from library.families.base import Components

    family = get_family("qwen_image")
    c = Components(None, None, [], [], options=QwenImageOptions(model_version=version))
    assert (family.base_model_version(c), family.modelspec_architecture(c, 1024)) == (base, arch)


def test_musubi_tuners_older_switches_name_the_version():
    """--edit / --edit_plus (musubi-tuner's older switches) are --model_version edit / edit-2509; two of them at
    once are one line."""
    from library.cli.entry import build_parser
    from library.cli.options import options_from_namespace

    family = get_family("qwen_image")
    parser = build_parser("test", family)

    def version(*argv):
        return options_from_namespace(QwenImageOptions, parser.parse_args(["--pretrained_model_name_or_path", PRESET,
                                                                          *argv])).version

    assert (version(), version("--edit"), version("--edit_plus"), version("--model_version", "edit-2511")) == \
        ("original", "edit", "edit-2509", "edit-2511")
    with pytest.raises(ConfigError, match=r"^--edit_plus and --model_version edit-2511: they name the model version "
                                          r"twice; give --model_version only$"):
        version("--edit_plus", "--model_version", "edit-2511")


def test_the_image_processor_keeps_qwen_vl_limits(files):
    """The VL image processor (built, and as written to processor/) allows 3136..12845056 pixels as Qwen2.5-VL-7B's
    preprocessor_config.json: the original Edit's ~1024² condition image keeps its size (1036x1036 after the
    28-pixel rounding: 1369 tokens), where transformers' default (1003520) would shrink it."""
    from transformers import Qwen2VLImageProcessor

    from library.families.common.qwen_vl import vl_image_processor

    _, folder, _ = files
    for processor in (vl_image_processor(), Qwen2VLImageProcessor.from_pretrained(os.path.join(folder, "processor"))):
        grid = processor(images=[Image.new("RGB", (1024, 1024))], return_tensors="pt")["image_grid_thw"]
        assert grid.tolist() == [[1, 74, 74]]  # 1036 / 14 patches a side, 37² = 1369 tokens after the 2x2 merge
