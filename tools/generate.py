"""Generate images from a base model with zero or more LoRA files (the flags of sd-scripts' gen_img.py).

    python tools/generate.py --ckpt model.safetensors --outdir out --prompt "a cat --n blurry --d 42" \
        --network_weights my_lora.safetensors --network_mul 0.8 --steps 30 --sampler euler_a

Prompts come from --prompt or --from_file (.txt, .toml, .json: the sample prompt
formats); inline options (--n --w --h --d --s --l --g --ss) override the flags.
Images are written as <outdir>/im_<NN>_<YYYYmmddHHMMSS>_<seed>.png with the
settings in the PNG text.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.cli.flux import add_component_file_arguments, component_files  # noqa: E402
from library.cli.options import options_from_values  # noqa: E402
from library.core.errors import ConfigError, run_tool  # noqa: E402
from library.families.common.embeddings import expand_prompt  # noqa: E402
from library.families import DEFAULT_FAMILY, get_family, selected_family  # noqa: E402
from library.families.detect import detect_family  # noqa: E402
from library.sampling.samplers import sampler_names  # noqa: E402

logger = logging.getLogger("generate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--ckpt", required=True, help="base model: diffusers folder, .safetensors/.ckpt file or preset")
    g.add_argument("--vae", default=None, help="VAE to use instead of the model's own")
    g.add_argument("--v2", action="store_true", help="SD 2.x (detected from the model; kept for compatibility)")
    g.add_argument("--v_parameterization", action="store_true", help="the model predicts v (SD 2.x 768-v)")
    g.add_argument("--sdxl", action="store_true", help="the model is SDXL (default: SD 1.x/2.x)")
    g.add_argument("--flux", action="store_true", help="the model is FLUX.1 (a Chroma file or preset is found as Chroma)")
    add_component_file_arguments(g)
    g.add_argument("--clip_skip", type=int, default=None, help="text encoder layer from the end (2 = penultimate)")
    g.add_argument("--fp16", action="store_true", help="run the model in float16")
    g.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    g.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    g = p.add_argument_group("networks (one value per network)")
    g.add_argument("--network_module", nargs="*", default=[], help="module of each network (default: lycoris.kohya for a file with LyCORIS "
                                                                "modules, else networks.lora)")
    g.add_argument("--network_weights", nargs="*", default=[], help="LoRA / LyCORIS files")
    g.add_argument("--network_mul", nargs="*", type=float, default=[], help="multiplier of each network (default 1)")
    g.add_argument("--merge", "--network_merge", dest="merge", action="store_true",
                   help="merge the networks into the weights first (same images, faster)")
    g.add_argument("--textual_inversion_embeddings", nargs="*", default=[], metavar="FILE",
                   help="textual-inversion embeddings (SD 1.x/2.x, SDXL; .safetensors, A1111 .pt): each one's token "
                        "(the token_string it records, else its file name) can be used in prompts")
    g = p.add_argument_group("ControlNet")
    g.add_argument("--control_net", default=None, help="a ControlNet trained by the ControlNet scripts (a diffusers "
                                                       "folder or .safetensors file); its image: --control_image")
    g.add_argument("--lllite", "--control_net_lllite_models", dest="lllite", default=None,
                   help="SDXL ControlNet-LLLite file (sdxl_train_control_net_lllite.py); needs a control image")
    g.add_argument("--lllite_mul", type=float, default=1.0, help="multiplier of the --lllite network (default 1)")
    g = p.add_argument_group("images")
    g.add_argument("--outdir", required=True, help="folder for the images")
    g.add_argument("--prompt", default=None, help="one prompt (inline options allowed)")
    g.add_argument("--from_file", default=None, help="prompt file: .txt (one a line), .toml or .json")
    g.add_argument("--images_per_prompt", type=int, default=1)
    g.add_argument("--seed", type=int, default=None, help="seed of the first image; the k-th image gets seed + k")
    g.add_argument("--steps", type=int, default=None, help="denoising steps (default 30; FLUX.1 and Chroma 20)")
    g.add_argument("--scale", type=float, default=None,
                   help="CFG scale (default 7.5; FLUX.1 and Chroma 1.0, no negative pass; Chroma about 4)")
    g.add_argument("--guidance", type=float, default=None,
                   help="FLUX.1 (dev) distilled guidance, the --g of prompts (default 3.5; Chroma has none)")
    g.add_argument("--W", type=int, default=None, help="width in pixels (default 512; SDXL 1024)")
    g.add_argument("--H", type=int, default=None, help="height in pixels (default 512; SDXL 1024)")
    g.add_argument("--sampler", default=None, choices=sampler_names(),
                   help="sampler (default ddim; FLUX.1 flow_euler)")
    g.add_argument("--batch_size", type=int, default=1, help="images denoised together")
    g.add_argument("--control_image", "--guide_image_path", dest="control_image", nargs="+", default=[],
                   metavar="PATH",
                   help="the control image(s): with --control_net / --lllite the ControlNet's image (a prompt's --cn "
                        "overrides it), else an edit model's reference image(s) (FLUX.1 Kontext) for every prompt "
                        "without its own --ci")
    g.add_argument("--grid", action="store_true", help="also write a contact sheet of all images")
    add_image_input_arguments(p)
    return p


def add_image_input_arguments(p: argparse.ArgumentParser) -> None:
    """gen_img's img2img / inpainting / regional prompts / highres fix flags (docs/gen_img.md)."""
    g = p.add_argument_group("img2img, inpainting, highres fix (SD 1.x/2.x, SDXL, FLUX.1), regions (SD, SDXL)")
    g.add_argument("--image_path", default=None, help="img2img source: an image, or a folder whose images are used in "
                                                      "turn (resized to --W/--H when given, else their own size)")
    g.add_argument("--strength", type=float, default=None,
                   help="img2img: fraction of the steps run on the noised image, 0..1 (default 0.8)")
    g.add_argument("--mask_path", default=None,
                   help="inpainting mask (white = repaint) of the same size as the image; with a prompt `a AND b` "
                        "the regions of the sub-prompts (channel R, G, B)")
    g.add_argument("--highres_fix_scale", type=float, default=None,
                   help="highres fix: generate first at this fraction of --W/--H (e.g. 0.5), then upscale and "
                        "denoise again at full size")
    g.add_argument("--highres_fix_steps", type=int, default=28, help="highres fix: steps of the first stage")
    g.add_argument("--highres_fix_strength", type=float, default=None,
                   help="highres fix: img2img strength of the first stage (default: --strength)")
    g.add_argument("--highres_fix_latents_upscaling", action="store_true",
                   help="highres fix: upscale the first stage's latents (bicubic) instead of its image (LANCZOS); "
                        "SD 1.x/2.x and SDXL")


@dataclass
class GenerateOptions:
    """What one generate run needs (from flags, or built directly by tests and benchmarks)."""

    ckpt: str
    outdir: str
    prompts: list = field(default_factory=list)  # SamplePrompt
    family: str = DEFAULT_FAMILY
    vae: Optional[str] = None
    component_files: dict = field(default_factory=dict)  # FLUX.1 --clip_l / --t5xxl / --ae
    v2: bool = False
    v_parameterization: bool = False
    clip_skip: Optional[int] = None
    dtype: torch.dtype = torch.float32
    device: Optional[str] = None
    networks: list = field(default_factory=list)  # NetworkSpec
    control_net: Optional[str] = None  # --control_net
    merge: bool = False
    embeddings: list = field(default_factory=list)  # --textual_inversion_embeddings
    images_per_prompt: int = 1
    seed: Optional[int] = None
    overrides: object = None  # PromptOverrides
    batch_size: int = 1
    grid: bool = False
    images: list = field(default_factory=list)  # PIL images of --image_path
    strength: Optional[float] = None
    masks: list = field(default_factory=list)  # PIL images of --mask_path
    regions: bool = False  # ` AND ` splits prompts into regional sub-prompts (the family has them)
    highres_fix_scale: Optional[float] = None
    highres_fix_steps: int = 28
    highres_fix_strength: Optional[float] = None
    highres_fix_latents_upscaling: bool = False


def options_from_args(a: argparse.Namespace) -> GenerateOptions:
    """Check the flags and read the prompts; ConfigError on anything wrong."""
    from library.sampling.generate import PromptOverrides
    from library.sampling.prompts import load_prompts, parse_prompt_line
    from library.sampling.samplers import canonical_sampler
    from library.train.adapters.network_apply import network_specs

    if a.sdxl and a.flux:
        raise ConfigError("--sdxl and --flux: expected at most one")
    if bool(a.prompt) == bool(a.from_file):
        raise ConfigError("expected exactly one of --prompt or --from_file")
    for name in ("images_per_prompt", "batch_size", "steps", "W", "H"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}: expected an integer >= 1, got {value}")
    if a.guidance is not None and a.guidance < 0:
        raise ConfigError(f"--guidance: expected a number >= 0, got {a.guidance}")
    if a.fp16 and a.bf16:
        raise ConfigError("--fp16 and --bf16: expected at most one")
    try:
        prompts = [parse_prompt_line(a.prompt, "--prompt")] if a.prompt else \
            load_prompts(a.from_file, check_sampler=canonical_sampler, used=("am",))
    except ConfigError as e:
        raise ConfigError(f"--from_file: {e}" if a.from_file else str(e)) from None
    for flag, paths in (("--network_weights", a.network_weights), ("--control_image", a.control_image),
                        ("--textual_inversion_embeddings", a.textual_inversion_embeddings)):
        for path in paths:
            if not os.path.isfile(path):  # now, not after the model has loaded
                raise ConfigError(f"{flag} {path}: file not found")
    family = _family(a)
    images, masks = _image_inputs(a, family, prompts)
    regions = "regions" in getattr(get_family(family), "image_inputs", ())
    for p in prompts:
        prompt_multipliers(p, len(a.network_weights), a.merge)  # --am: checked now
    modules, weights, muls = list(a.network_module), list(a.network_weights), list(a.network_mul)
    # --control_image is the ControlNet's / LLLite's image with --control_net / an LLLite file (the first path),
    # else an edit model's reference image(s)
    guided = a.control_net is not None or a.lllite is not None or \
        LLLITE_MODULE in (modules or [_default_module(p) for p in weights])
    guide = a.control_image[0] if guided and a.control_image else None
    if a.lllite is not None:
        if not os.path.isfile(a.lllite):
            raise ConfigError(f"--lllite {a.lllite}: file not found")
        if not guide and not all(p.control_image for p in prompts):
            raise ConfigError(f"--lllite {a.lllite}: every prompt needs a control image: --control_image, or --cn in "
                              "the prompt")
        if len(muls) < len(weights):  # the --lllite multiplier goes after the other networks' (default 1) ones
            muls += [1.0] * (len(weights) - len(muls))
        modules = (modules or [_default_module(p) for p in weights]) + [LLLITE_MODULE]
        weights, muls = weights + [a.lllite], muls + [a.lllite_mul]
    if a.control_net and not os.path.exists(a.control_net):
        raise ConfigError(f"--control_net {a.control_net}: not found")
    if a.control_net and not guide and not all(p.control_image for p in prompts):
        raise ConfigError("--control_net: every prompt needs a control image: --control_image, or --cn in the prompt")
    return GenerateOptions(
        ckpt=a.ckpt, outdir=a.outdir, prompts=prompts,
        family=family, images=images, strength=a.strength, masks=masks, regions=regions, highres_fix_scale=a.highres_fix_scale,
        highres_fix_steps=a.highres_fix_steps, highres_fix_strength=a.highres_fix_strength,
        highres_fix_latents_upscaling=a.highres_fix_latents_upscaling,
        vae=a.vae, component_files=component_files(a), v2=a.v2, v_parameterization=a.v_parameterization, clip_skip=a.clip_skip,
        dtype=torch.float16 if a.fp16 else torch.bfloat16 if a.bf16 else torch.float32, device=a.device,
        networks=network_specs(modules or [_default_module(p) for p in weights], weights, muls), merge=a.merge,
        control_net=a.control_net, embeddings=list(a.textual_inversion_embeddings),
        images_per_prompt=a.images_per_prompt, seed=a.seed, batch_size=a.batch_size, grid=a.grid,
        overrides=PromptOverrides(width=a.W, height=a.H, steps=a.steps, scale=a.scale, guidance=a.guidance,
                                  sampler=a.sampler, control_images=() if guided else tuple(a.control_image),
                                  control_image=guide))

def _image_inputs(a: argparse.Namespace, family: str, prompts: list) -> tuple[list, list]:
    """The --image_path / --mask_path images, checked with --strength and the highres fix flags before any model
    loads; ConfigError on anything wrong."""
    from library.sampling.img2img import AND, check_strength, image_files, open_image

    check_strength(a.strength, "--strength")
    check_strength(a.highres_fix_strength, "--highres_fix_strength")
    if a.highres_fix_scale is not None and not 0 < a.highres_fix_scale <= 1:
        raise ConfigError(f"--highres_fix_scale: expected a number in (0, 1] (the first stage's fraction of the "
                          f"size), got {a.highres_fix_scale}")
    if a.highres_fix_steps < 1:
        raise ConfigError(f"--highres_fix_steps: expected an integer >= 1, got {a.highres_fix_steps}")
    modes = tuple(getattr(get_family(family), "image_inputs", ()))
    # ` AND ` splits a prompt where the family has regional prompts; elsewhere it is part of the prompt
    regional = "regions" in modes and any(AND in p.prompt for p in prompts)
    used = [(f, mode) for f, mode, on in (
        ("--image_path", "img2img", a.image_path), ("--mask_path", "inpaint", a.mask_path and not regional),
        ("--highres_fix_scale", "highres", a.highres_fix_scale is not None)) if on]
    for flag, mode in used:
        if mode not in modes:
            raise ConfigError(f"{flag}: implemented for SD 1.x/2.x, SDXL and FLUX.1 only, not for {family} models")
    if a.highres_fix_latents_upscaling and a.highres_fix_scale is None:
        raise ConfigError("--highres_fix_latents_upscaling: expected --highres_fix_scale with it")
    if a.highres_fix_latents_upscaling and "highres_latents" not in modes:
        raise ConfigError(f"--highres_fix_latents_upscaling: implemented for SD 1.x/2.x and SDXL only, not for "
                          f"{family} models")
    if a.strength is not None and a.image_path is None and a.highres_fix_scale is None:
        raise ConfigError("--strength: expected --image_path (img2img) or --highres_fix_scale with it")
    images = [open_image(p, "--image_path", "RGB") for p in image_files(a.image_path, "--image_path")] \
        if a.image_path else []
    paths = image_files(a.mask_path, "--mask_path") if a.mask_path else []
    masks = [open_image(p, "--mask_path", "RGB") for p in paths]
    if masks and not images and not (regional and all(AND in p.prompt for p in prompts)):
        raise ConfigError("--mask_path: expected --image_path (inpainting) or a prompt with AND (regions)"
                          + (" for every prompt" if regional else ""))
    if masks and images:
        if len(masks) not in (1, len(images)):
            raise ConfigError(f"--mask_path: expected 1 mask or one per image ({len(images)}), got {len(masks)}")
        for i, image in enumerate(images):
            mask = masks[i % len(masks)]
            if mask.size != image.size:
                raise ConfigError(f"--mask_path {paths[i % len(masks)]}: expected the size of its image "
                                  f"{image.size[0]}x{image.size[1]}, got {mask.size[0]}x{mask.size[1]}")
    if regional and masks and a.network_weights:
        raise ConfigError("--mask_path with AND and --network_weights: sd-scripts' regional LoRA (one network a "
                          "region) is not implemented; regions apply to the sub-prompts only")
    return images, masks


def prompt_multipliers(p, networks: int, merge: bool) -> Optional[tuple]:
    """A prompt's ` --am 0.5,1.0`: one multiplier per network, the last repeated for the rest (sd-scripts'
    gen_img); None without --am. ConfigError for a bad value, more values than networks, or --network_merge."""
    value = p.ignored.get("am")
    if value is None:
        return None
    where = f"prompt {p.prompt!r}: --am {value}"
    try:
        muls = [float(v) for v in value.split(",")]
    except ValueError:
        raise ConfigError(f"{where}: expected comma-separated numbers (one multiplier per network)") from None
    if not networks:
        raise ConfigError(f"{where}: expected --network_weights (a multiplier per network)")
    if len(muls) > networks:
        raise ConfigError(f"{where}: expected at most {networks} values (one per --network_weights)")
    if merge:
        raise ConfigError(f"{where}: per-prompt multipliers need hooked networks; drop --network_merge")
    return tuple(muls + [muls[-1]] * (networks - len(muls)))


def attach_image_inputs(o: GenerateOptions, requests: list) -> None:
    """Give each request its ImageInput: the k-th request gets image k and mask k (cycling), a prompt `a AND b`
    its regions (the mask's channels, or the whole image each)."""
    from library.sampling.img2img import AND, DEFAULT_STRENGTH, ImageInput, image_tensor, mask_tensor, region_tensor

    strength = DEFAULT_STRENGTH if o.strength is None else o.strength
    for k, r in enumerate(requests):
        image = o.images[k % len(o.images)] if o.images else None
        mask = o.masks[k % len(o.masks)] if o.masks else None
        if image is not None:
            width, height = r.width or image.size[0], r.height or image.size[1]
            r.width, r.height = width - width % 8, height - height % 8
        regions = None
        count = len(r.prompt.split(AND)) if o.regions else 1
        if count > 1:
            if mask is not None:
                regions = region_tensor(mask, count, *mask.size)
            else:
                regions = torch.ones(count, 8, 8)  # no mask: the sub-prompts share every pixel
            mask = None
        if image is None and regions is None:
            continue
        r.image_input = ImageInput(
            image=image_tensor(image, r.width, r.height) if image is not None else None,
            strength=strength if image is not None else 1.0,
            mask=mask_tensor(mask.convert("L"), r.width, r.height) if mask is not None else None,
            regions=regions)


def _default_module(path: str) -> str:
    """The --network_module a file needs when none is given: lycoris.kohya for LyCORIS modules (LoHa, LoKr, DoRA,
    OFT, IA3, ...), which networks.lora cannot build, else networks.lora."""
    from networks.lycoris_delta import is_lycoris_state

    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                keys = list(f.keys())
        except Exception:  # not readable: networks.lora says what is wrong with it
            return "networks.lora"
        if any(k.startswith("lllite_unet_") for k in keys):
            return LLLITE_MODULE
        return "lycoris.kohya" if is_lycoris_state(keys) else "networks.lora"
    return "networks.lora"


LLLITE_MODULE = "networks.control_net_lllite"


def _family(a: argparse.Namespace) -> str:
    """--sdxl / --flux, else what the model says; a Chroma file or preset is Chroma with or without --flux
    (sd-scripts' FLUX.1 scripts take Chroma with --model_type chroma)."""
    detected = detect_family(a.ckpt)
    selected = selected_family(vars(a))
    if selected is None:
        return detected or DEFAULT_FAMILY
    return detected if detected is not None and get_family(detected).variant_of == selected else selected


def load_model(o: GenerateOptions):
    """(family, components) on the device, in eval mode; ConfigError for a family that cannot generate yet."""
    from library.families import get_family
    from library.families.base import LoadOptions, ModelFamily

    try:
        family = get_family(o.family)
    except ConfigError:
        raise ConfigError(f"--{o.family}: {o.family} models are not supported yet") from None
    if type(family).generate is ModelFamily.generate:
        raise ConfigError(f"--{o.family}: image generation for {o.family} models is not implemented yet")
    device = torch.device(o.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    options = options_from_values(family.options_type, o.component_files)
    components = family.load(LoadOptions(o.ckpt, vae=o.vae, v2=o.v2, v_parameterization=o.v_parameterization,
                                         dtype=o.dtype, vae_dtype=torch.float32, family_options=options))
    for module in [components.denoiser, *components.text_encoders]:
        if module.dtype != o.dtype:  # (diffusers warns on every .to() that names a dtype)
            module.to(dtype=o.dtype)
        module.to(device).eval().requires_grad_(False)
    vae = components.vae
    if vae.dtype != torch.float32:
        vae.to(dtype=torch.float32)  # SD's VAE overflows to NaN in fp16; decoding once is cheap in fp32
    vae.to(device).eval().requires_grad_(False)
    return family, components, device


def _load_embeddings(family, components, paths: list) -> tuple:
    """--textual_inversion_embeddings into the loaded model; (token, its vectors spelled out) of multi-vector ones."""
    from library.train.adapters.textual_inversion import load_embeddings

    return load_embeddings(family, components, paths) if paths else ()


def run(o: GenerateOptions, loaded=None) -> list[str]:
    """Generate every image of `o`; returns the written paths.

    `loaded` reuses a (family, components, device) from load_model; with `o.merge` the
    networks are merged into those weights for good.
    """
    from library.sampling.generate import requests_from_prompts
    from library.sampling.output import save_samples
    from library.train.adapters.network_apply import apply_networks

    family, components, device = loaded or load_model(o)
    family.check_loaded(components, o)  # --clip_skip against the loaded text encoder
    if not family.control_hint and (o.overrides and o.overrides.control_images or any(p.control_images for p in o.prompts)):
        raise ConfigError(f"--control_image / --ci: {family.name} models take no control images (edit models do: "
                          "FLUX.1 Kontext)")
    spelled = _load_embeddings(family, components, o.embeddings)
    applied = apply_networks(family, components, o.networks, o.merge, device, o.dtype)
    if o.control_net:  # predict adds its residuals for the requests' control images
        components.controlnet = family.create_controlnet(components, o.control_net).to(device, o.dtype).eval()
    try:
        requests = requests_from_prompts(o.prompts, o.images_per_prompt, o.seed, o.overrides, number_images=True)
        if spelled:  # a multi-vector token written in a prompt stands for all its vectors
            requests = [dataclasses.replace(r, prompt=expand_prompt(r.prompt, spelled),
                                            negative_prompt=expand_prompt(r.negative_prompt, spelled))
                        for r in requests]
        attach_image_inputs(o, requests)
        per_image = [prompt_multipliers(p, len(o.networks), o.merge) for p in o.prompts
                     for _ in range(o.images_per_prompt)]
        generated = []
        for muls, group in _multiplier_groups(per_image, requests):
            for network, mul in zip(applied.networks, muls or [n.multiplier for n in o.networks]):
                network.set_multiplier(mul)  # a prompt's --am, else --network_mul
            generated += _generate(o, family, components, device, group, applied.networks)
    finally:
        applied.remove()
        components.controlnet = None
    networks = ", ".join(f"{os.path.basename(n.weights)}:{n.multiplier}" for n in o.networks) or None
    extra = {"model": os.path.basename(os.path.normpath(o.ckpt)), "networks": networks}
    return save_samples(generated, o.outdir, "im", None, extra=extra, grid=o.grid, always_seed=True)


# sd-scripts gen_img.py flags accepted with nothing to do here (docs/gen_img.md): flag -> (takes values, why).
GEN_IMG_ACCEPTED = {
    "--xformers": (False, "attention runs in PyTorch SDPA"),
    "--sdpa": (False, "attention runs in PyTorch SDPA"),
    "--diffusers_xformers": (False, "attention runs in PyTorch SDPA"),
    "--no_half_vae": (False, "the VAE always runs in float32"),
    "--opt_channels_last": (False, "a memory layout; the same images"),
    "--vae_batch_size": (True, "the VAE decodes each batch; the same images"),
    "--vae_slices": (True, "the VAE decodes whole images; the same images"),
    "--v1": (False, "the model's version is read from the model"),
    "--no_preview": (False, "there is no interactive mode"),
    "--tokenizer_cache_dir": (True, "tokenizers come with the model or the presets"),
}
# sd-scripts gen_img.py flags accepted by the parser but refused when used: not implemented (docs/gen_img.md).
GEN_IMG_REFUSED = {
    "--highres_fix_upscaler": "upscaler modules are not supported; the highres fix upscales with LANCZOS",
    "--highres_fix_upscaler_args": "upscaler modules are not supported",
    "--highres_fix_save_1st": "the first stage's images are not saved",
    "--highres_fix_disable_control_net": "no ControlNet in the highres fix",
    "--network_regional_mask_max_color_codes": "regions come from the mask's R, G, B channels",
    "--network_args": "networks are built from their files",
    "--network_pre_calc": "use --network_merge",
    "--network_merge_n_models": "--network_merge merges every network",
    "--network_show_meta": "use tools/show_metadata.py",
    "--textual_inversion_embeddings": "textual inversion embeddings are not supported by this generator yet",
    "--interactive": "no interactive mode",
    "--n_iter": "use --images_per_prompt",
    "--iter_same_seed": "use --seed or the prompt option --d",
    "--shuffle_prompts": "prompts run in file order",
    "--negative_scale": "one CFG scale for the negative prompt",
    "--max_embeddings_multiples": "prompts of any length are split into 75-token windows",
    "--emb_normalize_mode": "weighted prompts are scaled as tools/generate.py scales them",
    "--from_module": "prompts come from --prompt or --from_file",
    "--prompter_module_args": "prompts come from --prompt or --from_file",
    "--sequential_file_name": "files are named im_NN_<time>_<seed>.png",
    "--use_original_file_name": "files are named im_NN_<time>_<seed>.png",
    "--replace_clip_l14_336": "the model's own text encoder is used",
    "--force_scheduler_zero_steps_offset": "the scheduler keeps SD's steps_offset",
    "--zero_terminal_snr": "not available in generation",
    "--ddim_eta": "DDIM runs with eta 0",
    "--original_width": "SDXL size conditioning is the image's size",
    "--original_height": "SDXL size conditioning is the image's size",
    "--original_width_negative": "SDXL size conditioning is the image's size",
    "--original_height_negative": "SDXL size conditioning is the image's size",
    "--crop_top": "SDXL crop conditioning is (0, 0)",
    "--crop_left": "SDXL crop conditioning is (0, 0)",
    "--noise_offset_prob": "no noise offset in generation",
    "--noise_offset_range": "no noise offset in generation",
    "--pyramid_noise_prob": "no pyramid noise in generation",
    "--pyramid_noise_discount_range": "no pyramid noise in generation",
    "--guide_image_path": "ControlNet is not supported by gen_img.py here",
    "--control_net_models": "ControlNet is not supported by gen_img.py here",
    "--control_net_lllite_models": "ControlNet-LLLite is not supported by gen_img.py here",
    "--control_net_preps": "ControlNet is not supported by gen_img.py here",
    "--control_net_multipliers": "ControlNet is not supported by gen_img.py here",
    "--control_net_ratios": "ControlNet is not supported by gen_img.py here",
    "--clip_vision_strength": "no CLIP Vision conditioning",
    "--ds_depth_1": "no Deep Shrink", "--ds_timesteps_1": "no Deep Shrink", "--ds_depth_2": "no Deep Shrink",
    "--ds_timesteps_2": "no Deep Shrink", "--ds_ratio": "no Deep Shrink",
    "--gradual_latent_timesteps": "no Gradual Latent", "--gradual_latent_ratio": "no Gradual Latent",
    "--gradual_latent_ratio_step": "no Gradual Latent", "--gradual_latent_every_n_steps": "no Gradual Latent",
    "--gradual_latent_s_noise": "no Gradual Latent", "--gradual_latent_unsharp_params": "no Gradual Latent",
}
# sd-scripts store_true flags among the refused ones; every other refused flag takes values (any number, any text).
_GEN_IMG_SWITCHES = {"--highres_fix_save_1st", "--highres_fix_disable_control_net",
                     "--network_pre_calc", "--network_show_meta", "--interactive", "--iter_same_seed",
                     "--shuffle_prompts", "--sequential_file_name", "--use_original_file_name",
                     "--replace_clip_l14_336", "--force_scheduler_zero_steps_offset", "--zero_terminal_snr"}
GEN_IMG_HARMLESS = {"--n_iter": 1.0, "--ddim_eta": 0.0}  # values that ask for what this generator does anyway


def build_gen_img_parser(sdxl: bool = False) -> argparse.ArgumentParser:
    """gen_img.py / sdxl_gen_img.py: this generator's flags with sd-scripts' gen_img defaults (--steps 50,
    --outdir outputs) and its other flags accepted (no-op) or refused when used."""
    p = build_parser()
    p.description = "sd-scripts' " + ("sdxl_gen_img.py" if sdxl else "gen_img.py") + ": " + p.description
    p.set_defaults(steps=50, outdir="outputs")
    for action in p._actions:
        if "--outdir" in action.option_strings:
            action.required = False
    known = {s for action in p._actions for s in action.option_strings}
    g = p.add_argument_group("sd-scripts gen_img flags accepted with nothing to do")
    for flag, (values, why) in GEN_IMG_ACCEPTED.items():
        if flag not in known:
            kind = {"nargs": "*", "metavar": "VALUE"} if values else {"action": "store_true"}
            g.add_argument(flag, help=f"accepted: {why}", **kind)
    g = p.add_argument_group("sd-scripts gen_img flags refused when used (not implemented)")
    for flag, why in GEN_IMG_REFUSED.items():
        if flag in known:  # implemented by the generator (another branch may add it)
            continue
        if flag in _GEN_IMG_SWITCHES:
            g.add_argument(flag, action="store_true", help=f"refused: {why}")
        else:
            g.add_argument(flag, nargs="*", default=None, metavar="VALUE", help=f"refused: {why}")
    return p


def check_gen_img_refused(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ConfigError for the first refused gen_img flag that was used."""
    for action in parser._actions:
        flag = next((s for s in action.option_strings if s in GEN_IMG_REFUSED), None)
        if flag is None or not (action.help or "").startswith("refused"):
            continue
        value = getattr(args, action.dest)
        if value in (None, False) or _harmless(flag, value):
            continue
        raise ConfigError(f"{flag}: not implemented ({GEN_IMG_REFUSED[flag]}); see docs/gen_img.md")


def _harmless(flag: str, value) -> bool:
    try:
        return flag in GEN_IMG_HARMLESS and len(value) == 1 and float(value[0]) == GEN_IMG_HARMLESS[flag]
    except ValueError:
        return False


def gen_img_main(argv: Optional[list[str]] = None, sdxl: bool = False) -> int:
    """gen_img.py (SD 1.x/2.x, SDXL with --sdxl) and sdxl_gen_img.py (SDXL): this generator under sd-scripts'
    flags."""
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if sdxl and "--sdxl" not in argv:
        argv.append("--sdxl")
    parser = build_gen_img_parser(sdxl)
    args = parser.parse_args(argv)

    def body() -> None:
        check_gen_img_refused(args, parser)
        start = time.time()
        paths = run(options_from_args(args))
        print(f"wrote {len(paths)} image(s) to {args.outdir} in {time.time() - start:.1f}s")

    return run_tool(body)


def _multiplier_groups(per_image: list, requests: list) -> list:
    """Consecutive requests that share their networks' multipliers: [(multipliers or None, requests)]."""
    groups: list = []
    for muls, r in zip(per_image, requests):
        if groups and groups[-1][0] == muls:
            groups[-1][1].append(r)
        else:
            groups.append((muls, [r]))
    return groups


def _generate(o: GenerateOptions, family, components, device, requests: list, networks: list) -> list:
    """txt2img / img2img / inpainting / regions, with the highres fix when asked; `networks`: the applied ones
    (an image network such as ControlNet-LLLite gets each request's control image)."""
    from library.sampling.image_networks import generate_with_image_networks

    if o.highres_fix_scale is None:
        return generate_with_image_networks(family, components, networks, requests, clip_skip=o.clip_skip,
                                            device=device, batch_size=o.batch_size, progress=True)
    from library.sampling.img2img import DEFAULT_STRENGTH, generate_highres

    return generate_highres(
        family, components, requests, scale=o.highres_fix_scale, steps_1st=o.highres_fix_steps,
        strength_1st=o.highres_fix_strength if o.highres_fix_strength is not None else o.strength,
        strength_2nd=DEFAULT_STRENGTH if o.strength is None else o.strength,
        default_size=family.default_image_size, upscale_latents=o.highres_fix_latents_upscaling,
        clip_skip=o.clip_skip, device=device, batch_size=o.batch_size, progress=True)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)

    def body() -> None:
        start = time.time()
        paths = run(options_from_args(args))
        print(f"wrote {len(paths)} image(s) to {args.outdir} in {time.time() - start:.1f}s")

    return run_tool(body)


if __name__ == "__main__":
    sys.exit(main())
