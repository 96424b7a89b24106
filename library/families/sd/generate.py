"""Image generation for SD 1.x / 2.x: weighted CLIP prompts, CFG, and a diffusers scheduler loop.

The loop itself (`generate_ddpm`) is shared with SDXL: a family gives only how
prompts become the conditioning its `predict` reads.

A small loop rather than StableDiffusionPipeline: the prompts are encoded by our
own chunked, weighted encoder (the one training uses), each image's start noise
comes from its own CPU generator (same image on any device and in any batch),
and nothing the pipeline needs besides the model (safety checker, feature
extractor) has to exist.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Callable, Optional

import numpy as np
import torch

from library.families.base import Components, ModelFamily, TextConditioning
from library.families.common.clip_text import encode_token_chunks
from library.sampling.generate import GeneratedImage, control_image_rows
from library.sampling.img2img import (
    blend_known,
    combine_regions,
    latent_masks,
    region_weights,
    start_latents,
    sub_prompts,
)
from library.sampling.prompt_weighting import (
    apply_token_weights,
    chunk_count,
    tokens_with_weights,
    weighted_windows,
)
from library.sampling.samplers import make_scheduler
from library.families.common.flow_sampling import borrowed_on

logger = logging.getLogger(__name__)

# condition(texts, first_request) -> (text conditioning, batch dict) for family.predict
Conditioner = Callable[[list, object], tuple[TextConditioning, dict]]

# The scheduler settings every SD 1.x / 2.x checkpoint ships with.
SD_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}
# sd-scripts' sampling defaults for SD.
DEFAULT_SIZE = 512
DEFAULT_STEPS = 30
DEFAULT_SCALE = 7.5
DEFAULT_SAMPLER = "ddim"
SIZE_MULTIPLE = 8  # the VAE's downscale factor


def resolve_request(request, default_size: int = DEFAULT_SIZE):
    """The request with SD's defaults filled in (size `default_size`) and the size rounded down to a multiple of 8."""
    def size(value: Optional[int]) -> int:
        value = value or default_size
        return max(SIZE_MULTIPLE * 8, value - value % SIZE_MULTIPLE)

    return dataclasses.replace(
        request, width=size(request.width), height=size(request.height),
        steps=request.steps or DEFAULT_STEPS,
        scale=DEFAULT_SCALE if request.scale is None else request.scale,
        sampler=request.sampler or DEFAULT_SAMPLER)


@torch.no_grad()
def encode_prompts(components: Components, texts: list[str], clip_skip: Optional[int],
                   device: torch.device) -> torch.Tensor:
    """Weighted, chunked CLIP states (B, n*75+2, D) for texts that share one window count."""
    tokenizer, text_encoder = components.tokenizers[0], components.text_encoders[0]
    n_chunks = chunk_count([len(tokens_with_weights(tokenizer, t)[0]) for t in texts], tokenizer.model_max_length - 2)
    with borrowed_on(text_encoder, device):
        return encode_weighted(components, texts, clip_skip, n_chunks, device)


def encode_weighted(components: Components, texts: list[str], clip_skip: Optional[int], n_chunks: int,
                    device: torch.device) -> torch.Tensor:
    """Weighted CLIP states (B, n_chunks*75+2, D) of `texts` ("(word:1.2)" syntax), with gradients when the text
    encoder trains (--weighted_captions in training; sampling wraps it without)."""
    tokenizer, text_encoder = components.tokenizers[0], components.text_encoders[0]
    ids, weights = weighted_windows(tokenizer, texts, n_chunks)
    states = encode_token_chunks(text_encoder, ids.to(device), clip_skip, tokenizer.model_max_length)
    return apply_token_weights(states, weights.to(states.device))


def _step_kwargs(scheduler, generators: list[torch.Generator]) -> dict:
    # Only stochastic schedulers (ancestral, DDPM) take a generator; per-image generators keep
    # each image independent of its batch.
    params = inspect.signature(scheduler.step).parameters
    kwargs = {}
    if "generator" in params:
        kwargs["generator"] = generators if len(generators) > 1 else generators[0]
    if "eta" in params:
        kwargs["eta"] = 0.0
    return kwargs


@torch.no_grad()
def generate_sd(family: ModelFamily, components: Components, requests: list, clip_skip: Optional[int],
                device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    def condition(texts: list[str], first) -> tuple[TextConditioning, dict]:
        states = encode_prompts(components, texts, clip_skip, device)
        return TextConditioning(tensors={"encoder_hidden_states": states}), {}

    return generate_ddpm(family, components, requests, device, resolve_request, condition)


@torch.no_grad()
def generate_ddpm(family: ModelFamily, components: Components, requests: list, device: torch.device,
                  resolve: Callable, condition: Conditioner, scheduler_config: Optional[dict] = None) -> list:
    """The CFG denoising loop shared by the DDPM families (SD 1.x/2.x, SDXL).

    `resolve` fills a request's defaults; `condition(texts, first_request)` encodes the
    prompts (then the negatives when CFG is on) into the TextConditioning and batch dict
    that `family.predict` reads, every tensor batch-first with one row per text.
    """
    from PIL import Image


    resolved = [resolve(r) for r in requests]
    first = resolved[0]
    if any(r.batch_key() != first.batch_key() for r in resolved):
        raise ValueError("generate_ddpm: a batch must share size, steps, scale and sampler")
    unet, vae = components.denoiser, components.vae
    prediction = "v_prediction" if components.v_parameterization else "epsilon"
    schedule = getattr(components, "noise_schedule", None)  # --noise_scheduler_overrides, --timestep_spacing
    overrides = schedule.sampler_config() if schedule is not None else {}
    config = {**(scheduler_config or SD_SCHEDULER_CONFIG), **overrides, "prediction_type": prediction}
    scheduler = make_scheduler(first.sampler, config, kind="ddpm")
    scheduler.set_timesteps(first.steps, device=device)

    use_cfg = first.scale > 1.0
    inputs = [getattr(r, "image_input", None) for r in resolved]  # img2img / inpainting / regions (img2img.py)
    regional = inputs[0] is not None and inputs[0].regions is not None
    subs = [sub_prompts(r.prompt) if regional else [r.prompt] for r in resolved]
    count = len(subs[0])
    if any(len(s) != count for s in subs) or (regional and inputs[0].regions.shape[0] != count):
        raise ValueError("generate_ddpm: every prompt of a batch needs as many sub-prompts (AND) as regions")
    cond_texts = [t for s in subs for t in s]  # request-major, sub-prompt-minor
    texts = cond_texts + ([r.negative_prompt for r in resolved] if use_cfg else [])
    text, batch = condition(texts, first)
    control = control_image_rows(resolved, len(texts))  # a ControlNet's conditioning image (predict reads it)
    if control is not None:
        batch["conditioning_images"] = control
    # unconditional rows first, as diffusers pipelines order them
    order = torch.cat([torch.arange(len(cond_texts), len(texts)), torch.arange(len(cond_texts))]) if use_cfg else None
    text = TextConditioning(tensors={k: _rows(v, order, device, unet.dtype) for k, v in text.tensors.items()})
    batch = {k: _rows(v, order, device, unet.dtype) for k, v in batch.items()}

    generators = [torch.Generator("cpu").manual_seed(r.seed) for r in resolved]
    shape = (family.latent_channels, first.height // family.vae_scale_factor, first.width // family.vae_scale_factor)
    noise = torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)

    def encode(pixels: torch.Tensor) -> torch.Tensor:  # img2img: each image's posterior sample from its own seed
        posterior = [torch.Generator("cpu").manual_seed(r.seed) for r in resolved]
        with borrowed_on(vae, device):
            return family.scale_latents(family.encode_images(vae, pixels.to(device), generator=posterior))

    latents, timesteps, init = start_latents(scheduler, inputs, encode, noise, first.steps, family.vae_scale_factor)
    mask = latent_masks(inputs, shape[1:], device)
    weights = region_weights(inputs, shape[1:], device)
    step_kwargs = _step_kwargs(scheduler, generators)
    for i, t in enumerate(timesteps):
        cond_in = latents.repeat_interleave(count, dim=0) if count > 1 else latents
        model_in = torch.cat([latents, cond_in]) if use_cfg else cond_in
        model_in = scheduler.scale_model_input(model_in, t)
        pred = family.predict(components, model_in.to(unet.dtype), t, text, batch).float()
        if use_cfg:
            uncond, cond = pred[:len(resolved)], pred[len(resolved):]
            pred = uncond + first.scale * (combine_regions(cond, weights, count) - uncond)
        else:
            pred = combine_regions(pred, weights, count)
        latents = scheduler.step(pred, t, latents, **step_kwargs).prev_sample
        if mask is not None:
            latents = blend_known(scheduler, latents, init, noise, mask, timesteps[i + 1] if i + 1 < len(timesteps)
                                  else None)

    latents = latents / family.latents_scale + family.latents_shift
    with borrowed_on(vae, latents.device):  # with cached latents the VAE waits in CPU memory
        pixels = vae.decode(latents.to(latents.device, vae.dtype)).sample.float()
    if not torch.isfinite(pixels).all():
        logger.warning("generated image has NaN/inf values (fp16 overflow?); they are drawn black. "
                       "Try --no_half_vae or bf16")
        pixels = torch.nan_to_num(pixels, nan=-1.0, posinf=1.0, neginf=-1.0)
    pixels = ((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    images = (pixels * 255).round().astype(np.uint8)
    final = (latents - family.latents_shift) * family.latents_scale  # back to the denoiser's scale
    return [GeneratedImage(Image.fromarray(img), r, latents=x.float().cpu()) for img, r, x in
            zip(images, resolved, final)]


def _rows(tensor: torch.Tensor, order: Optional[torch.Tensor], device: torch.device, dtype: torch.dtype):
    """A conditioning tensor reordered for CFG, on the device, floats in the model's dtype."""
    if order is not None:
        tensor = tensor[order.to(tensor.device)]
    return tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)
