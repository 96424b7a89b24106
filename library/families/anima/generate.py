"""Image generation for Anima: Qwen3 + LLM adapter text, true CFG, and a flow-match Euler loop on shifted σ.

As sd-scripts' anima sampler: σ from 1 to 0 in `steps` linear steps shifted by 3.0
(σ' = 3σ / (1 + 2σ)), CFG scale 7.5 with the negative prompt ("" when none) as a
second pass, 30 steps, 512x512, sizes rounded down to a multiple of 16. The adapter's
output for each prompt is computed once and reused by every step. Each image's start
noise comes from its own CPU generator, so it does not depend on its batch or device.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from library.families.base import Components, ModelFamily
from library.families.common.flow_sampling import euler_sample, initial_noise, prompts_then_negatives, resolve_batch, resolve_flow_request
from library.families.common.flow_sampling import borrowed_on
from library.objectives.flow import shift_sigmas
from library.sampling.generate import GeneratedImage

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 512
DEFAULT_STEPS = 30
DEFAULT_SCALE = 7.5
FLOW_SHIFT = 3.0
SIZE_MULTIPLE = 16
MIN_SIZE = 64


def resolve_anima_request(request):
    """The request with sd-scripts' Anima defaults filled in and the size rounded down to a multiple of 16."""
    return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE)


def anima_sigmas(steps: int) -> torch.Tensor:
    """steps + 1 σ from 1 down to 0, shifted by FLOW_SHIFT."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), FLOW_SHIFT).float()


def decode_latents(family, vae: torch.nn.Module, latents: torch.Tensor) -> np.ndarray:
    """Normalised latents (B, 16, h, w) -> uint8 images (B, H, W, 3)."""
    latents = family.denormalize_latents(vae, latents)
    with borrowed_on(vae, latents.device):
        pixels = vae.decode(latents.unsqueeze(2).to(vae.dtype)).sample[:, :, 0].float()
    if not torch.isfinite(pixels).all():
        logger.warning("generated image has NaN/inf values (fp16 overflow?); they are drawn black. Try bf16")
        pixels = torch.nan_to_num(pixels, nan=-1.0, posinf=1.0, neginf=-1.0)
    pixels = ((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return (pixels * 255).round().astype(np.uint8)


@torch.no_grad()
def generate_anima(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    from PIL import Image

    resolved = resolve_batch(requests, resolve_anima_request, "generate_anima")
    first = resolved[0]
    dit = components.denoiser
    use_cfg = first.scale > 1.0
    texts = prompts_then_negatives(resolved, use_cfg)
    tokens = family.tokenize(components, texts, None)
    with borrowed_on(components.text_encoders[0], device):
        t = family.encode_text(components, tokens, None).tensors
    with borrowed_on(dit, device):
        context = dit.text_embeddings(*(t[k].to(device) for k in family.TEXT_KEYS))

        def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
            timesteps = torch.full((model_in.shape[0],), sigma, device=device)
            return dit.denoise(model_in.to(dit.dtype), timesteps, context.to(dit.dtype))

        latents = euler_sample(initial_noise(family, resolved, device), anima_sigmas(first.steps), velocity,
                               first.scale, use_cfg)
    images = decode_latents(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
