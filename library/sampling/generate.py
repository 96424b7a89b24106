"""The generation core shared by sampling during training and tools/generate.py.

Prompts become fully seeded `GenerationRequest`s; requests that share a size,
step count, scale and sampler are batched and handed to the family's
`generate`, which owns the model-specific denoising loop. Every image has its
own seed and its own noise generator, so an image does not depend on what else
is in its batch, and a seed gives the same image here and in training samples.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch

from library.core.errors import ConfigError
from library.sampling.prompts import SamplePrompt
from library.sampling.samplers import canonical_sampler

logger = logging.getLogger(__name__)

SEED_RANGE = 2**31


@dataclass
class GenerationRequest:
    """One image to make. None fields take the family's default (SD: 512x512, 30 steps, CFG 7.5, ddim)."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    width: Optional[int] = None
    height: Optional[int] = None
    steps: Optional[int] = None
    scale: Optional[float] = None
    guidance: Optional[float] = None
    sampler: Optional[str] = None
    index: int = 0  # NN in the file name: the prompt's position (training) or the image's (tool)
    seed_given: bool = False  # the user chose the seed: it goes into the file name, as in sd-scripts
    control_images: tuple[str, ...] = ()  # edit models (FLUX.1 Kontext): the reference image file(s)
    control_image: Optional[str] = None  # the ControlNet's conditioning image (a file), resized to the image size
    image_input: Any = None  # library.sampling.img2img.ImageInput: img2img / inpainting / regional prompts

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one denoising batch."""
        key = (self.width, self.height, self.steps, self.scale, self.guidance, self.sampler, self.control_images,
               self.control_image is not None)
        return key if self.image_input is None else key + (self.image_input.batch_key(),)


def control_image_rows(requests: Sequence[GenerationRequest], rows: int) -> Optional[Any]:
    """The batch's "conditioning_images" for `predict`: each request's control image as RGB, resized (Lanczos) to
    its width x height, (rows, 3, H, W) in 0..1, repeated for the negative rows of CFG (rows = 2 x requests);
    None when the requests have none."""
    if not requests or requests[0].control_image is None:
        return None
    import numpy as np
    from PIL import Image

    images = []
    for r in requests:
        with Image.open(r.control_image) as img:
            rgb = img.convert("RGB").resize((r.width, r.height), Image.Resampling.LANCZOS)
        images.append(torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1))
    out = torch.stack(images)
    return out.repeat(rows // len(requests), 1, 1, 1)


@dataclass
class GeneratedImage:
    """An image and the request that made it, with every default filled in."""

    image: Any  # PIL.Image.Image
    request: GenerationRequest
    latents: Any = None  # the final scaled latents (C, h, w) on the CPU where the family keeps them (highres fix)


@dataclass
class PromptOverrides:
    """Values from flags that apply where a prompt does not set its own (tools/generate.py)."""

    width: Optional[int] = None
    height: Optional[int] = None
    steps: Optional[int] = None
    scale: Optional[float] = None
    guidance: Optional[float] = None
    sampler: Optional[str] = None
    negative_prompt: Optional[str] = None
    control_images: tuple[str, ...] = ()  # tools/generate.py --control_image: for prompts without their own --ci
    control_image: Optional[str] = None  # tools/generate.py --control_image with --control_net / --lllite


def requests_from_prompts(prompts: Sequence[SamplePrompt], images_per_prompt: int = 1,
                          seed: Optional[int] = None, overrides: Optional[PromptOverrides] = None,
                          rng: Optional[random.Random] = None, number_images: bool = False) -> list[GenerationRequest]:
    """Turn prompts into seeded requests.

    Seeds: a prompt's own seed (`--d`) gives its images seed, seed+1, ...; otherwise
    `seed` (the tool's --seed) gives the k-th image of the run seed + k; otherwise a
    random seed is drawn from `rng` (recorded in the PNG metadata either way).
    `number_images` numbers files by image (the tool) instead of by prompt (training).
    """
    o = overrides or PromptOverrides()
    rng = rng or random.Random()
    out: list[GenerationRequest] = []
    for p in prompts:
        sampler = p.sampler or o.sampler
        if sampler is not None:
            sampler = canonical_sampler(sampler)
        for j in range(images_per_prompt):
            k = len(out)
            if p.seed is not None:
                image_seed, given = p.seed + j, True
            elif seed is not None:
                image_seed, given = seed + k, True
            else:
                image_seed, given = rng.randrange(SEED_RANGE), False
            out.append(GenerationRequest(
                prompt=p.prompt,
                negative_prompt=p.negative_prompt or o.negative_prompt or "",
                seed=image_seed % SEED_RANGE if given else image_seed,
                width=p.width or o.width, height=p.height or o.height, steps=p.steps or o.steps,
                scale=p.scale if p.scale is not None else o.scale,
                guidance=p.guidance if p.guidance is not None else o.guidance,
                sampler=sampler, index=k if number_images else p.index, seed_given=given,
                control_images=tuple(p.control_images or o.control_images),
                control_image=p.control_image or o.control_image))
    return out


def batches(requests: Sequence[GenerationRequest], batch_size: int) -> list[list[GenerationRequest]]:
    """Consecutive requests with the same batch key, at most batch_size per batch."""
    if batch_size < 1:
        raise ConfigError(f"--batch_size: expected an integer >= 1, got {batch_size}")
    out: list[list[GenerationRequest]] = []
    for r in requests:
        if out and len(out[-1]) < batch_size and out[-1][0].batch_key() == r.batch_key():
            out[-1].append(r)
        else:
            out.append([r])
    return out


class ImageGenerator(Protocol):
    """What generate_images needs of a model family (library/families/base.py ModelFamily.generate)."""
    def generate(self, components: Any, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list: ...


@torch.no_grad()
def generate_images(family: ImageGenerator, components: Any, requests: Sequence[GenerationRequest], *,
                    clip_skip: Optional[int] = None, device: Optional[torch.device] = None, batch_size: int = 1,
                    progress: bool = False) -> list[GeneratedImage]:
    """Generate every request, in order, batching where the settings allow."""
    from tqdm.auto import tqdm

    device = device or components.denoiser.device
    out: list[GeneratedImage] = []
    groups = batches(requests, batch_size)
    for group in tqdm(groups, desc="images", disable=not progress, unit="batch"):
        out += family.generate(components, group, clip_skip=clip_skip, device=device)
    return out








