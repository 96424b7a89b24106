"""gen_img's img2img / inpainting / regional prompts / highres fix flags of tools/generate.py, and their checks:
the images are read and checked against each other, the family and the prompts before any model loads."""

from __future__ import annotations

import argparse

from library.core.errors import ConfigError
from library.families import get_family
from library.sampling.img2img import AND, check_strength, image_files, open_image


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


def image_inputs_from_args(a: argparse.Namespace, family: str, prompts: list) -> tuple[list, list, bool]:
    """(images, masks, regions): the --image_path / --mask_path images, checked with --strength and the highres fix
    flags before any model loads, and whether ` AND ` splits prompts into regions (the family has them);
    ConfigError on anything wrong."""
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
    return images, masks, "regions" in modes
