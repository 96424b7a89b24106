"""Image generation for FLUX.2 klein, as diffusers' Flux2KleinPipeline: Qwen3 text (the empty caption as the negative),
classifier-free guidance when the scale is above 1 (the distilled klein models are sampled without: --l 1; the base
models with, the pipeline's default 4.0), flow-match Euler on klein's scheduler: `steps` σ evenly from 1 to 1/steps,
time-shifted by the empirical μ of the image size and step count (diffusers' compute_empirical_mu), then 0.

FLUX.2 [dev] as diffusers' Flux2Pipeline: the same schedule, Mistral text, the guidance value `--g` (request.guidance)
fed to the guidance embedding (no classifier-free guidance unless `--l` > 1).

Defaults: 4 steps and scale 1.0 (FLUX.2-klein-4B, step-distilled); with --model_version klein-base-4b / -9b 50 steps
and scale 4.0; dev 50 steps and guidance 4.0 (the pipelines' and musubi-tuner's); 1024x1024 rounded to multiples of 16.
Each image's start noise comes from its own CPU generator.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from library.families.base import Components, ModelFamily, TextConditioning
from library.families.common.flow_sampling import (borrowed_on, encode_control_images, euler_sample, initial_noise,
                                                   prompts_then_negatives, resolve_batch, resolve_flow_request)
from library.sampling.generate import GeneratedImage

DEFAULT_SIZE = 1024
DEFAULT_STEPS = 4
DEFAULT_SCALE = 1.0
BASE_STEPS, BASE_SCALE = 50, 4.0  # klein base models (Flux2KleinPipeline's defaults)
DEV_STEPS, DEV_GUIDANCE = 50, 4.0  # FLUX.2 [dev] (Flux2Pipeline's defaults)
SIZE_MULTIPLE = 16
MIN_SIZE = 16


def empirical_mu(image_tokens: int, steps: int) -> float:
    """diffusers' compute_empirical_mu (pipeline_flux2_klein): μ linear in the token count, and between 10 and 200
    steps linear in the step count."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_tokens > 4300:
        return float(a2 * image_tokens + b2)
    m_200 = a2 * image_tokens + b2
    m_10 = a1 * image_tokens + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + m_200 - 200.0 * a)


def flux2_sigmas(steps: int, image_tokens: int) -> torch.Tensor:
    """steps + 1 σ of the pipeline's scheduler for an image of `image_tokens` 2x2 patches."""
    mu = empirical_mu(image_tokens, steps)
    sigmas = np.linspace(1.0, 1.0 / steps, steps)
    sigmas = math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))
    return torch.tensor(np.append(sigmas, 0.0), dtype=torch.float32)


@torch.no_grad()
def generate_flux2(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    from PIL import Image

    model = components.denoiser
    dev = bool(model.config.guidance_embeds)
    version = family.options(components).model_version or ""
    steps, scale = (BASE_STEPS, BASE_SCALE) if version.startswith("klein-base") else (DEFAULT_STEPS, DEFAULT_SCALE)

    def resolve(request):
        if dev:
            return resolve_flow_request(request, DEFAULT_SIZE, DEV_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE,
                                        guidance=DEV_GUIDANCE)
        return resolve_flow_request(request, DEFAULT_SIZE, steps, scale, SIZE_MULTIPLE, MIN_SIZE)

    resolved = resolve_batch(requests, resolve, "generate_flux2")
    first = resolved[0]
    use_cfg = first.scale > 1.0
    texts = prompts_then_negatives(resolved, use_cfg)
    encoder, = components.text_encoders
    with borrowed_on(encoder, device):
        text = family.encode_text(components, family.tokenize(components, texts, None), None)
    text = TextConditioning({k: v.to(device) for k, v in text.tensors.items()})
    batch = {"guidance": torch.full((len(texts),), float(first.guidance), device=device)} if dev else {}

    # reference images (--control_image / --ci): resized to cover the output and centre-cropped, as in training
    with borrowed_on(components.vae, device):
        controls = encode_control_images(family, components.vae, first.control_images, first.width, first.height,
                                         device)

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)
        if controls:
            batch["scaled_control_latents"] = [c.expand(model_in.shape[0], -1, -1, -1) for c in controls]
        return family.predict(components, model_in.to(model.dtype), timesteps, text, batch)

    latents = initial_noise(family, resolved, device)
    h, w = latents.shape[-2:]
    sigmas = flux2_sigmas(first.steps, (h // 2) * (w // 2))
    latents = euler_sample(latents, sigmas, velocity, first.scale, use_cfg)
    images = family.decode_latents(components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
