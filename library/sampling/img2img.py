"""img2img, inpainting, regional prompts (`AND`) and the highres fix of gen_img.py / tools/generate.py.

A request carries an `ImageInput` (GenerationRequest.image_input); the DDPM loop of the families that have
`image_inputs = True` (SD 1.x/2.x, SDXL: library/families/sd/generate.py) reads it:

* img2img: the image is encoded by the VAE, noised to the timestep of `strength` (diffusers' and sd-scripts'
  `int(steps * strength)` last steps) and denoised from there. Strength 1 starts from the seed's noise alone, so it
  is txt2img with the same seed; strength 0 runs no step and returns the decode of the image's latents.
* inpainting (`mask`, white = repaint): after every step the kept region is replaced by the image's latents noised
  to the next timestep (the RePaint-style latent blend of diffusers' legacy inpaint pipeline, which sd-scripts'
  gen_img uses for models that are not inpainting models); after the last step by the image's latents themselves.
* regional prompts: a prompt `a AND b AND c` is denoised as its sub-prompts; their conditional noise predictions
  are combined per latent pixel by the region weights (`regions`, one map a sub-prompt, normalised to sum to 1;
  where no region covers a pixel the sub-prompts share it equally), then CFG against the one negative prompt.
* highres fix (`generate_highres`): sd-scripts' two stages; stage 1 at `scale` times the size (multiple of 32) with
  `steps_1st` steps, its image upscaled with LANCZOS and denoised again at full size as img2img with seed + 1.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from library.core.errors import ConfigError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
AND = " AND "  # sd-scripts' sub-prompt separator (with the spaces)
DEFAULT_STRENGTH = 0.8  # sd-scripts' gen_img default for --strength
MAX_REGION_CHANNELS = 3  # regions come from the mask's R, G, B channels, as sd-scripts' regional masks


@dataclass
class ImageInput:
    """What a request starts from or keeps: tensors at the request's pixel size (resized by the loop if not)."""

    image: Optional[torch.Tensor] = None  # (3, H, W) in [-1, 1]: img2img / inpainting source
    latents: Optional[torch.Tensor] = None  # (C, h, w) scaled latents instead of an image (highres fix, latents)
    strength: float = 1.0  # fraction of the steps run on the noised image (1: txt2img noise)
    mask: Optional[torch.Tensor] = None  # (H, W) in [0, 1], 1 = repaint
    regions: Optional[torch.Tensor] = None  # (K, H, W) >= 0: one weight map a sub-prompt

    def batch_key(self) -> tuple:
        return (self.image is not None or self.latents is not None, self.latents is not None, self.strength,
                self.mask is not None,
                None if self.regions is None else self.regions.shape[0])


def sub_prompts(prompt: str) -> list[str]:
    """`a AND b` -> ["a", "b"] (sd-scripts splits on " AND " with its spaces)."""
    return prompt.split(AND)


def image_files(path: str, flag: str) -> list[str]:
    """The image files of `path` (one file, or a folder's .png/.jpg/.jpeg/.webp, sorted); ConfigError if none."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: no such file or folder")
    files = sorted(p for p in glob.glob(os.path.join(path, "*")) if p.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
        raise ConfigError(f"{flag} {path}: expected an image file or a folder with .png/.jpg/.jpeg/.webp images, "
                          f"found none")
    return files


def open_image(path: str, flag: str, mode: str):
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert(mode)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input
        raise ConfigError(f"{flag} {path}: not a readable image ({e})") from None


def image_tensor(image, width: int, height: int) -> torch.Tensor:
    """A PIL RGB image resized (LANCZOS, as sd-scripts) to width x height, as (3, H, W) in [-1, 1]."""
    from PIL import Image

    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def mask_tensor(mask, width: int, height: int) -> torch.Tensor:
    """A PIL mask (L) resized to width x height as (H, W) in [0, 1], 1 (white) = repaint."""
    from PIL import Image

    if mask.size != (width, height):
        mask = mask.resize((width, height), Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)


def region_tensor(mask, count: int, width: int, height: int) -> torch.Tensor:
    """(count, H, W) region weights from an RGB mask: sub-prompt k < 3 gets channel k (R, G, B), later ones the
    whole image (sd-scripts' by-channel regional masks)."""
    from PIL import Image

    if mask.size != (width, height):
        mask = mask.resize((width, height), Image.Resampling.LANCZOS)
    rgb = torch.from_numpy(np.asarray(mask.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
    maps = [rgb[k] if k < MAX_REGION_CHANNELS else torch.ones(height, width) for k in range(count)]
    return torch.stack(maps)


def check_strength(value: Optional[float], flag: str) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ConfigError(f"{flag}: expected a number in 0..1, got {value}")


def attach_image_inputs(requests: list, images: list, masks: list, strength: Optional[float], regions: bool) -> None:
    """Give each request its ImageInput: the k-th request gets image k and mask k (cycling: PIL images), a prompt
    `a AND b` its regions (with `regions`: the mask's channels, or the whole image each); `strength` None: the
    default."""
    strength = DEFAULT_STRENGTH if strength is None else strength
    for k, r in enumerate(requests):
        image = images[k % len(images)] if images else None
        mask = masks[k % len(masks)] if masks else None
        if image is not None:
            width, height = r.width or image.size[0], r.height or image.size[1]
            r.width, r.height = width - width % 8, height - height % 8
        weights = None
        count = len(r.prompt.split(AND)) if regions else 1
        if count > 1:
            if mask is not None:
                weights = region_tensor(mask, count, *mask.size)
            else:
                weights = torch.ones(count, 8, 8)  # no mask: the sub-prompts share every pixel
            mask = None
        if image is None and weights is None:
            continue
        r.image_input = ImageInput(
            image=image_tensor(image, r.width, r.height) if image is not None else None,
            strength=strength if image is not None else 1.0,
            mask=mask_tensor(mask.convert("L"), r.width, r.height) if mask is not None else None,
            regions=weights)


def _init_latents(inputs: Sequence[ImageInput], encode, noise: torch.Tensor, vae_scale_factor: int) -> torch.Tensor:
    """The start latents of img2img at the noise's size: given latents resized (bicubic, as sd-scripts'
    --highres_fix_latents_upscaling), else the images resized (bilinear) and encoded."""
    height, width = noise.shape[-2:]
    if inputs[0].latents is not None:
        return torch.stack([_fit(i.latents[None].float(), height, width, "bicubic")[0]
                            for i in inputs]).to(noise.device, noise.dtype)
    size = (height * vae_scale_factor, width * vae_scale_factor)
    pixels = torch.stack([_fit(i.image[None].float(), *size, "bilinear")[0] for i in inputs])
    return encode(pixels).to(noise.device, noise.dtype)


# --- the denoising loop's side (library/families/sd/generate.py) -------------------------------------------------

def _fit(tensor: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """(N, C, h, w) resized to (height, width) unless it already has that size."""
    if tuple(tensor.shape[-2:]) == (height, width):
        return tensor
    if mode == "area":
        return F.interpolate(tensor, size=(height, width), mode="area")
    return F.interpolate(tensor, size=(height, width), mode=mode, align_corners=False)


def start_latents(scheduler, inputs: Sequence[ImageInput], encode, noise: torch.Tensor, steps: int,
                  vae_scale_factor: int):
    """(latents, timesteps, init_latents): where the loop starts for img2img, and the image's latents (None without
    an image). `noise` is the seeds' start noise (unscaled); `encode(pixels)` gives the scaled latents of (B, 3, H, W)
    images in [-1, 1]."""
    first = inputs[0]
    if first is None or (first.image is None and first.latents is None):
        return noise * scheduler.init_noise_sigma, scheduler.timesteps, None
    init = _init_latents(inputs, encode, noise, vae_scale_factor)
    init_steps = min(int(steps * first.strength), steps)
    t_start = (steps - init_steps) * scheduler.order
    timesteps = scheduler.timesteps[t_start:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(t_start)
    if len(timesteps) == 0:
        return init, timesteps, init
    if first.strength >= 1.0:
        return noise * scheduler.init_noise_sigma, timesteps, init  # the seed's noise alone: txt2img
    return scheduler.add_noise(init, noise, timesteps[:1].repeat(init.shape[0])), timesteps, init


def latent_masks(inputs: Sequence[ImageInput], shape: tuple, device) -> Optional[torch.Tensor]:
    """(B, 1, h, w) repaint weights at latent size (area-averaged), or None without a mask."""
    if inputs[0] is None or inputs[0].mask is None:
        return None
    return torch.stack([_fit(i.mask[None, None].float(), *shape, "area")[0] for i in inputs]).to(device)


def region_weights(inputs: Sequence[ImageInput], shape: tuple, device) -> Optional[torch.Tensor]:
    """(B, K, 1, h, w) per-sub-prompt weights summing to 1 at every latent pixel, or None without regions."""
    if inputs[0] is None or inputs[0].regions is None:
        return None
    maps = torch.stack([_fit(i.regions[None].float(), *shape, "area")[0] for i in inputs])  # (B, K, h, w)
    total = maps.sum(dim=1, keepdim=True)
    uniform = torch.full_like(maps, 1.0 / maps.shape[1])
    weights = torch.where(total > 0, maps / total.clamp_min(1e-12), uniform)
    return weights[:, :, None].to(device)


def combine_regions(cond: torch.Tensor, weights: Optional[torch.Tensor], count: int) -> torch.Tensor:
    """The conditional predictions (B*K, C, h, w), sub-prompt-minor, combined into (B, C, h, w)."""
    if weights is None:
        return cond
    cond = cond.reshape(-1, count, *cond.shape[1:])
    return (cond * weights.to(cond.dtype)).sum(dim=1)


def blend_known(scheduler, latents: torch.Tensor, init: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor,
                next_t) -> torch.Tensor:
    """Inpainting: the kept region (mask 0) replaced by the image's latents at the next timestep's noise level."""
    if next_t is None:
        known = init
    else:
        known = scheduler.add_noise(init, noise, next_t.reshape(1).repeat(init.shape[0]))
    return mask * latents + (1 - mask) * known


# --- flow-matching families (FLUX.1: library/families/flux/generate.py) ------------------------------------------

def flow_start(inputs: Sequence[ImageInput], encode, noise: torch.Tensor, sigmas: torch.Tensor,
               vae_scale_factor: int):
    """(latents, sigmas, init_latents) of a rectified-flow img2img: the last `int(steps * strength)` Euler steps,
    from x = (1 - σ) · image + σ · noise at their first σ (strength 1: the noise alone, as txt2img; 0: no step, the
    image's latents). Without an image: (noise, sigmas, None). `encode(pixels)` gives the model's latents."""
    first = inputs[0]
    if first is None or (first.image is None and first.latents is None):
        return noise, sigmas, None
    init = _init_latents(inputs, encode, noise, vae_scale_factor)
    steps = len(sigmas) - 1
    sigmas = sigmas[steps - min(int(steps * first.strength), steps):]
    if len(sigmas) == 1:
        return init, sigmas, init
    if first.strength >= 1.0:
        return noise, sigmas, init
    sigma = float(sigmas[0])
    return (1 - sigma) * init + sigma * noise, sigmas, init


def flow_blend(latents: torch.Tensor, init: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor,
               sigma: float) -> torch.Tensor:
    """Inpainting for a flow model: the kept region (mask 0) replaced by the image's latents at noise level σ."""
    return mask * latents + (1 - mask) * ((1 - sigma) * init + sigma * noise)


# --- highres fix ---------------------------------------------------------------------------------------------------

def first_stage_size(value: int, scale: float) -> int:
    """sd-scripts: int(size * scale + 0.5), rounded down to a multiple of 32 (at least 64)."""
    size = int(value * scale + 0.5)
    return max(64, size - size % 32)


@torch.no_grad()
def generate_highres(family, components, requests: list, *, scale: float, steps_1st: int,
                     strength_1st: Optional[float], strength_2nd: float, default_size: int,
                     upscale_latents: bool = False, **kwargs) -> list:
    """sd-scripts' highres fix: each request generated at `scale` times its size with `steps_1st` steps (img2img
    requests with `strength_1st`, else their own strength), upscaled with LANCZOS to the full size and denoised
    again with the request's steps as img2img (`strength_2nd`) from seed + 1; the inpainting mask is not used in
    the second stage (sd-scripts drops it there). `upscale_latents`: the first stage's latents are upscaled
    (bicubic) instead of its image (sd-scripts' --highres_fix_latents_upscaling). The results carry the requests
    as given."""
    from library.sampling.generate import generate_images

    first: list = []
    for r in requests:
        width, height = r.width or default_size, r.height or default_size
        inp = getattr(r, "image_input", None)
        if inp is not None and inp.image is not None and strength_1st is not None:
            inp = dataclasses.replace(inp, strength=strength_1st)
        first.append(dataclasses.replace(r, width=first_stage_size(width, scale),
                                         height=first_stage_size(height, scale), steps=steps_1st, image_input=inp))
    stage1 = generate_images(family, components, first, **kwargs)
    second: list = []
    for r, g in zip(requests, stage1):
        width, height = r.width or default_size, r.height or default_size
        width, height = width - width % 8, height - height % 8
        inp = getattr(r, "image_input", None)
        regions = inp.regions if inp is not None else None
        if upscale_latents:
            start = {"latents": g.latents}
        else:
            start = {"image": image_tensor(g.image.convert("RGB"), width, height)}
        second.append(dataclasses.replace(r, width=width, height=height, seed=r.seed + 1, image_input=ImageInput(
            strength=strength_2nd, regions=regions, **start)))
    stage2 = generate_images(family, components, second, **kwargs)
    for r, g in zip(requests, stage2):
        g.request = dataclasses.replace(g.request, seed=r.seed)  # the file name and metadata keep the asked seed
    return stage2
