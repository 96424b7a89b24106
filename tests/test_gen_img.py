"""gen_img.py / sdxl_gen_img.py on the tiny SD 1.x and SDXL models: img2img, inpainting, regional prompts (AND),
the highres fix, and sd-scripts' gen_img flags mapped onto tools/generate.py."""

from __future__ import annotations

import glob
import re

import numpy as np
import pytest
import torch
from PIL import Image

from library.core.errors import ConfigError
from library.sampling.generate import GenerationRequest, generate_images
from library.sampling.img2img import ImageInput, generate_highres, image_tensor, region_tensor
from tools import generate as tool

PRESETS = {"sd1": ["--ckpt", "tiny:sd1"], "sdxl": ["--ckpt", "tiny:sdxl", "--sdxl"]}
ARGS = ["--W", "64", "--H", "64", "--steps", "4", "--scale", "4", "--sampler", "ddim", "--device", "cpu"]


@pytest.fixture(scope="module", params=sorted(PRESETS))
def loaded(request):
    args = tool.build_parser().parse_args([*PRESETS[request.param], "--outdir", "unused", "--prompt", "x"])
    return tool.load_model(tool.options_from_args(args))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 64x64 RGB image with structure (gradients and a square), its repaint mask (right half white), and an RGB
    region mask (left half red, right half green)."""
    folder = tmp_path_factory.mktemp("gen_img")
    y, x = np.mgrid[0:64, 0:64]
    rgb = np.stack([x * 4, y * 4, np.full_like(x, 128)], axis=-1).astype(np.uint8)
    rgb[20:44, 20:44] = (250, 30, 30)
    Image.fromarray(rgb).save(folder / "in.png")
    (folder / "images").mkdir()
    for name in ("a.png", "b.jpg"):  # a folder of images is used in turn
        Image.fromarray(rgb).save(folder / "images" / name)
    mask = np.zeros((64, 64), np.uint8)
    mask[:, 32:] = 255
    Image.fromarray(mask).save(folder / "mask.png")
    regions = np.zeros((64, 64, 3), np.uint8)
    regions[:, :32, 0] = 255
    regions[:, 32:, 1] = 255
    Image.fromarray(regions).save(folder / "regions.png")
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(folder / "small_mask.png")
    return folder


def request(prompt="a red cat", seed=7, steps=4, image_input=None, **kw):
    return GenerationRequest(prompt, "blurry", seed=seed, width=64, height=64, steps=steps, scale=4.0,
                             sampler=kw.pop("sampler", "ddim"), image_input=image_input, **kw)


def pixels(generated) -> np.ndarray:
    return np.stack([np.asarray(g.image.convert("RGB")) for g in generated]).astype(np.int16)


def source_input(source, strength, mask=False) -> ImageInput:
    image = image_tensor(Image.open(source / "in.png").convert("RGB"), 64, 64)
    m = torch.from_numpy(np.asarray(Image.open(source / "mask.png"), np.float32) / 255) if mask else None
    return ImageInput(image=image, strength=strength, mask=m)


def run(loaded, requests, **kw):
    family, components, device = loaded
    return generate_images(family, components, requests, device=device, **kw)


@pytest.mark.parametrize("sampler", ["ddim", "euler_a", "heun", "dpmsolver++", "pndm"])
def test_strength_one_is_txt2img_with_the_same_seed(loaded, source, sampler):
    txt = pixels(run(loaded, [request(sampler=sampler)]))
    img = pixels(run(loaded, [request(sampler=sampler, image_input=source_input(source, 1.0))]))
    assert np.array_equal(txt, img)
    half = pixels(run(loaded, [request(sampler=sampler, image_input=source_input(source, 0.5))]))
    assert np.abs(half - txt).mean() > 5  # the image matters below strength 1


def test_strength_zero_is_the_decode_of_the_image_latents(loaded, source):
    family, c, device = loaded
    out = pixels(run(loaded, [request(image_input=source_input(source, 0.0))]))
    image = image_tensor(Image.open(source / "in.png").convert("RGB"), 64, 64)[None]
    with torch.no_grad():
        latents = family.scale_latents(family.encode_images(c.vae, image, generator=[torch.Generator().manual_seed(7)]))
        decoded = c.vae.decode(latents / family.latents_scale + family.latents_shift).sample.float()
    expected = (((decoded + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.int16)
    assert np.array_equal(out, expected)


def test_inpainting_keeps_the_unmasked_region(loaded, source, monkeypatch):
    """The kept half's latents are the image's latents exactly (the last blend puts them back). In pixels the tiny
    VAE decoder's mid-block attention spreads the repainted half over the whole image, so pixels are compared with a
    measured bound: kept half mean |diff| to the image's decode 25.4 (SD) / 29.0 (SDXL) of 255 against 36.6 / 36.6
    with no mask."""
    family, c, _ = loaded
    decoded = []
    decode = c.vae.decode
    monkeypatch.setattr(c.vae, "decode", lambda latents, *a, **k: decoded.append(latents.clone()) or
                        decode(latents, *a, **k))
    kept = pixels(run(loaded, [request(image_input=source_input(source, 0.0))]))  # the image's own decode
    painted = pixels(run(loaded, [request(image_input=source_input(source, 1.0, mask=True))]))
    plain = pixels(run(loaded, [request(image_input=source_input(source, 1.0))]))
    image_latents, painted_latents, plain_latents = decoded
    assert torch.equal(painted_latents[..., :4], image_latents[..., :4])  # mask 0 on latent columns 0-3
    assert (painted_latents[..., 4:] - image_latents[..., 4:]).abs().mean() > 0.1
    assert (plain_latents[..., :4] - image_latents[..., :4]).abs().mean() > 0.1
    left, right = np.s_[:, :, :24], np.s_[:, :, 40:]  # away from the mask's edge
    assert np.abs(painted[left] - kept[left]).mean() < 0.8 * np.abs(plain[left] - kept[left]).mean()
    assert np.abs(painted[left] - kept[left]).mean() < 30
    assert np.abs(painted[right] - kept[right]).mean() > 30


def test_and_with_two_regions_differs_from_each_prompt_alone(loaded, source):
    mask = Image.open(source / "regions.png")
    both = ImageInput(regions=region_tensor(mask, 2, 64, 64))
    a, b = "a red cat", "a blue dog on grass"
    combined = pixels(run(loaded, [request(f"{a} AND {b}", image_input=both)]))
    alone_a = pixels(run(loaded, [request(a)]))
    alone_b = pixels(run(loaded, [request(b)]))
    assert np.abs(combined - alone_a).mean() > 1 and np.abs(combined - alone_b).mean() > 1
    # a region covering the whole image is that sub-prompt alone (up to batched text encoding)
    only_a = ImageInput(regions=torch.stack([torch.ones(64, 64), torch.zeros(64, 64)]))
    whole_a = pixels(run(loaded, [request(f"{a} AND {b}", image_input=only_a)]))
    assert np.abs(whole_a - alone_a).max() <= 1


def test_highres_fix_makes_the_full_size_from_a_smaller_first_stage(loaded):
    family, c, device = loaded
    r = request(steps=3)
    r.width = r.height = 128
    out = generate_highres(family, c, [r], scale=0.5, steps_1st=2, strength_1st=None, strength_2nd=0.7,
                           default_size=family.default_image_size, device=device)
    assert out[0].image.size == (128, 128) and out[0].request.seed == 7
    assert (out[0].request.width, out[0].request.height, out[0].request.steps) == (128, 128, 3)
    plain = run(loaded, [r])
    assert np.abs(pixels(out) - pixels(plain)).mean() > 1


def gen_img(preset, tmp_path, name, *extra):
    out = tmp_path / name
    code = tool.gen_img_main([*PRESETS[preset], "--outdir", str(out), "--prompt", "a red cat --n blurry --d 11",
                              *ARGS, *extra])
    return code, sorted(glob.glob(str(out / "*.png")))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_mode_writes_an_image_of_the_right_size(preset, tmp_path, source):
    cases = {
        "img2img": ["--image_path", str(source / "in.png"), "--strength", "0.6"],
        "inpaint": ["--image_path", str(source / "images"), "--mask_path", str(source / "mask.png")],  # a folder of images
        "highres": ["--highres_fix_scale", "0.5", "--highres_fix_steps", "2", "--W", "128", "--H", "96"],
        "highres_latents": ["--highres_fix_scale", "0.5", "--highres_fix_steps", "2", "--W", "128", "--H", "96",
                            "--highres_fix_latents_upscaling"],
    }
    for name, extra in cases.items():
        code, paths = gen_img(preset, tmp_path, name, *extra)
        assert code == 0, name
        size = (128, 96) if name.startswith("highres") else (64, 64)
        assert [Image.open(p).size for p in paths] == [size], name


def test_gen_img_equals_generate_for_the_same_settings(tmp_path):
    code, ours = gen_img("sd1", tmp_path, "gen_img", "--xformers", "--sdpa", "--no_half_vae")
    assert code == 0
    assert tool.main([*PRESETS["sd1"], "--outdir", str(tmp_path / "generate"), "--prompt",
                      "a red cat --n blurry --d 11", *ARGS]) == 0
    theirs = sorted(glob.glob(str(tmp_path / "generate" / "*.png")))
    assert np.array_equal(np.asarray(Image.open(ours[0])), np.asarray(Image.open(theirs[0])))


def test_gen_img_defaults_and_sdxl_entry():
    p = tool.build_gen_img_parser(sdxl=True)
    a = p.parse_args(["--ckpt", "m", "--prompt", "x"])
    assert (a.steps, a.outdir, a.highres_fix_steps, a.strength, a.xformers) == (50, "outputs", 28, None, False)
    b = tool.build_parser().parse_args(["--ckpt", "m", "--prompt", "x", "--outdir", "o"])
    assert b.steps is None  # generate.py keeps the family's default (30)


@pytest.mark.parametrize("extra, message", [
    (["--strength", "1.5", "--image_path", "{src}/in.png"], "--strength: expected a number in 0..1, got 1.5"),
    (["--image_path", "{src}/missing.png"], "--image_path {src}/missing.png: no such file or folder"),
    (["--image_path", "{src}/in.png", "--mask_path", "{src}/small_mask.png"],
     "--mask_path {src}/small_mask.png: expected the size of its image 64x64, got 32x32"),
    (["--mask_path", "{src}/mask.png"], "--mask_path: expected --image_path (inpainting) or a prompt with AND"),
    (["--strength", "0.5"], "--strength: expected --image_path (img2img) or --highres_fix_scale with it"),
    (["--highres_fix_scale", "2"], "--highres_fix_scale: expected a number in (0, 1]"),
    (["--highres_fix_save_1st"], "--highres_fix_save_1st: not implemented"),
    (["--highres_fix_latents_upscaling"], "--highres_fix_latents_upscaling: expected --highres_fix_scale with it"),
    (["--textual_inversion_embeddings", "x.pt"], "--textual_inversion_embeddings: not implemented"),
    (["--n_iter", "2"], "--n_iter: not implemented (use --images_per_prompt)"),
])
def test_bad_input_is_one_line_before_any_model_loads(extra, message, source, tmp_path, capsys):
    base = {s for a in tool.build_parser()._actions for s in a.option_strings}
    if extra[0] in base and "not implemented" in message:
        pytest.skip(f"{extra[0]} is implemented by tools/generate.py now")
    extra = [e.replace("{src}", str(source)) for e in extra]
    # the model does not exist: an error about it would mean the input was checked too late
    code = tool.gen_img_main(["--ckpt", str(tmp_path / "no_model.safetensors"), "--outdir", str(tmp_path / "o"),
                              "--prompt", "x", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + message.replace("{src}", str(source)))


def test_n_iter_one_is_accepted():
    p = tool.build_gen_img_parser()
    tool.check_gen_img_refused(p.parse_args(["--ckpt", "m", "--prompt", "x", "--n_iter", "1"]), p)
    with pytest.raises(ConfigError, match="--network_pre_calc: not implemented"):
        tool.check_gen_img_refused(p.parse_args(["--ckpt", "m", "--prompt", "x", "--network_pre_calc"]), p)


def test_img2img_is_refused_for_families_without_it(tmp_path, capsys, source):
    code = tool.main(["--ckpt", "tiny:sd3", "--outdir", str(tmp_path), "--prompt", "x",
                      "--image_path", str(source / "in.png")])
    err = capsys.readouterr().err
    assert code == 2 and "--image_path: implemented for SD 1.x/2.x, SDXL and FLUX.1 only, not for sd3 models" in err
    # AND is part of the prompt where a family has no regional prompts: no split, no error
    a = tool.build_parser().parse_args(["--ckpt", "tiny:flux", "--flux", "--outdir", "o", "--prompt", "a AND b"])
    assert tool.options_from_args(a).regions is False


@pytest.fixture(scope="module")
def flux():
    args = tool.build_parser().parse_args(["--ckpt", "tiny:flux", "--flux", "--outdir", "unused", "--prompt", "x"])
    return tool.load_model(tool.options_from_args(args))


def flux_request(image_input=None, sampler="flow_euler"):
    return GenerationRequest("a red cat", "", seed=5, width=64, height=64, steps=4, scale=1.0, guidance=3.5,
                             sampler=sampler, image_input=image_input)


def test_flux_img2img_and_inpainting(flux, source, monkeypatch):
    """Flow img2img: strength 1 is txt2img bitwise, strength 0 the decode of the image's latents, inpainting keeps
    the unmasked latents exactly."""
    family, c, device = flux
    decoded = []
    decode = c.vae.decode
    monkeypatch.setattr(c.vae, "decode", lambda latents, *a, **k: decoded.append(latents.clone()) or
                        decode(latents, *a, **k))
    txt = pixels(run(flux, [flux_request()]))
    one = pixels(run(flux, [flux_request(source_input(source, 1.0))]))
    assert np.array_equal(txt, one)
    zero = pixels(run(flux, [flux_request(source_input(source, 0.0))]))
    half = pixels(run(flux, [flux_request(source_input(source, 0.5))]))
    assert np.abs(half - txt).mean() > 1 and np.abs(half - zero).mean() > 1
    image = image_tensor(Image.open(source / "in.png").convert("RGB"), 64, 64)[None]
    expected = family.encode_images(c.vae, image, generator=[torch.Generator().manual_seed(5)])
    painted = pixels(run(flux, [flux_request(source_input(source, 1.0, mask=True))]))
    image_latents, painted_latents = decoded[2], decoded[4]  # the strength-0 and the inpainting decodes
    from library.families.common.flow_sampling import decode_images

    assert np.array_equal(zero, decode_images(family, c.vae, expected).astype(np.int16))
    assert torch.equal(painted_latents[..., :4], image_latents[..., :4])
    assert (painted_latents[..., 4:] - image_latents[..., 4:]).abs().mean() > 0.1
    assert painted.shape == txt.shape == (1, 64, 64, 3)


def test_flux_gen_img_modes_write_images(tmp_path, source):
    for name, extra in {"img2img": ["--image_path", str(source / "in.png"), "--strength", "0.5"],
                        "highres": ["--highres_fix_scale", "0.5", "--highres_fix_steps", "2", "--W", "128"]}.items():
        out = tmp_path / name
        assert tool.main(["--ckpt", "tiny:flux", "--flux", "--outdir", str(out), "--prompt", "a cat --d 1",
                          "--steps", "3", "--device", "cpu", "--H", "64", *extra]) == 0
        assert [Image.open(p).size for p in glob.glob(str(out / "*.png"))] == \
            [(128, 64) if name == "highres" else (64, 64)]


def test_prompt_am_sets_the_network_multipliers(tmp_path, source):
    """` --am 0` equals no network; ` --am 1` equals --network_mul 1; the run's --network_mul applies elsewhere."""
    from tests.train_helpers import random_lora_file

    args = tool.build_parser().parse_args(["--ckpt", "tiny:sd1", "--outdir", "unused", "--prompt", "x"])
    loaded = tool.load_model(tool.options_from_args(args))
    family, c, _ = loaded
    lora = random_lora_file(family, c, str(tmp_path / "toy.safetensors"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --d 3 --am 0\na red cat --d 3\na red cat --d 3 --am 1\n")

    def generate(name, mul, from_file=True, net=True):
        a = tool.build_parser().parse_args(["--ckpt", "tiny:sd1", "--outdir", str(tmp_path / name), *ARGS,
                                            *(["--from_file", str(prompts)] if from_file else
                                              ["--prompt", "a red cat --d 3"]),
                                            *(["--network_weights", lora, "--network_mul", str(mul)] if net else [])])
        return [np.asarray(Image.open(p)) for p in sorted(tool.run(tool.options_from_args(a), loaded))]

    am0, half, am1 = generate("am", 0.5)
    base, = generate("base", 0, from_file=False, net=False)
    full, = generate("full", 1.0, from_file=False)
    hooked_half, = generate("half", 0.5, from_file=False)
    assert np.array_equal(am0, base) and np.array_equal(am1, full) and np.array_equal(half, hooked_half)
    assert not np.array_equal(full, base)


@pytest.mark.parametrize("am, message", [
    ("x", "expected comma-separated numbers"), ("1,2", "expected at most 1 values"),
])
def test_bad_am_is_one_line(am, message, tmp_path):
    a = tool.build_parser().parse_args(["--ckpt", "tiny:sd1", "--outdir", "o", "--prompt", f"cat --am {am}",
                                        "--network_weights", __file__])
    with pytest.raises(ConfigError, match=message):
        tool.options_from_args(a)


# Every long option of sd-scripts 48d368fa's gen_img.py and sdxl_gen_img.py (setup_parser), without the dashes.
SD_SCRIPTS_GEN_IMG_FLAGS = """
    H W batch_size bf16 ckpt clip_skip clip_vision_strength control_net_lllite_models control_net_models
    control_net_multipliers control_net_preps control_net_ratios crop_left crop_top ddim_eta diffusers_xformers
    ds_depth_1 ds_depth_2 ds_ratio ds_timesteps_1 ds_timesteps_2 emb_normalize_mode
    force_scheduler_zero_steps_offset fp16 from_file from_module gradual_latent_every_n_steps
    gradual_latent_ratio gradual_latent_ratio_step gradual_latent_s_noise gradual_latent_timesteps
    gradual_latent_unsharp_params guide_image_path highres_fix_disable_control_net highres_fix_latents_upscaling
    highres_fix_save_1st highres_fix_scale highres_fix_steps highres_fix_strength highres_fix_upscaler
    highres_fix_upscaler_args image_path images_per_prompt interactive iter_same_seed mask_path
    max_embeddings_multiples n_iter negative_scale network_args network_merge network_merge_n_models
    network_module network_mul network_pre_calc network_regional_mask_max_color_codes network_show_meta
    network_weights no_half_vae no_preview noise_offset_prob noise_offset_range opt_channels_last
    original_height original_height_negative original_width original_width_negative outdir prompt
    prompter_module_args pyramid_noise_discount_range pyramid_noise_prob replace_clip_l14_336 sampler scale sdpa
    sdxl seed sequential_file_name shuffle_prompts steps strength textual_inversion_embeddings
    tokenizer_cache_dir use_original_file_name v1 v2 v_parameterization vae vae_batch_size vae_slices xformers
    zero_terminal_snr
""".split()


@pytest.mark.parametrize("sdxl", [False, True])
def test_every_sd_scripts_gen_img_flag_is_taken(sdxl):
    """Each flag is implemented, accepted with nothing to do, or refused with one line when used (docs/gen_img.md)."""
    p = tool.build_gen_img_parser(sdxl)
    ours = {s for a in p._actions for s in a.option_strings}
    assert sorted("--" + f for f in SD_SCRIPTS_GEN_IMG_FLAGS if "--" + f not in ours) == []
    with open("docs/gen_img.md", encoding="utf-8") as f:
        documented = set(re.findall(r"`(--[a-z0-9_A-Z]+)", f.read()))
    assert sorted("--" + f for f in SD_SCRIPTS_GEN_IMG_FLAGS if "--" + f not in documented) == []


def test_highres_fix_latents_upscaling_starts_from_the_upscaled_latents(loaded):
    """Strength 0 in the second stage: the image is the decode of the first stage's latents, bicubic-upscaled."""
    family, c, device = loaded
    r = request(steps=3)
    r.width = r.height = 128
    kw = dict(scale=0.5, steps_1st=2, strength_1st=None, default_size=family.default_image_size, device=device)
    out = generate_highres(family, c, [r], strength_2nd=0.0, upscale_latents=True, **kw)
    small = run(loaded, [request(steps=2, seed=7)])  # the first stage: 64x64, its own seed
    up = torch.nn.functional.interpolate(small[0].latents[None], size=(16, 16), mode="bicubic", align_corners=False)
    with torch.no_grad():
        decoded = c.vae.decode(up / family.latents_scale + family.latents_shift).sample.float()
    expected = (((decoded + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.int16)
    assert out[0].image.size == (128, 128)
    assert np.abs(pixels(out) - expected).max() <= 1  # the scale round trip x / s * s of the latents
    via_image = generate_highres(family, c, [r], strength_2nd=0.0, **kw)
    assert np.abs(pixels(via_image) - pixels(out)).mean() > 1


def test_latents_upscaling_is_refused_for_flux(tmp_path, capsys):
    code = tool.main(["--ckpt", "tiny:flux", "--flux", "--outdir", str(tmp_path), "--prompt", "x",
                      "--highres_fix_scale", "0.5", "--highres_fix_latents_upscaling"])
    assert code == 2 and "--highres_fix_latents_upscaling: implemented for SD 1.x/2.x and SDXL only, not for flux" \
        in capsys.readouterr().err
