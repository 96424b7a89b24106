"""Image generation for Chroma: T5 text with its attention mask, true CFG with a negative prompt, flow-match Euler.

As sd-scripts samples Chroma (flux_train_utils.sample_image_inference with --model_type chroma): the σ
schedule is FLUX.1's, always time-shifted by the image's token count; `--l` (request.scale, default 1.0)
runs a second pass on the negative prompt ("" when none is given) whenever it is not 1, and mixes the two
velocities as uncond + scale·(cond − uncond); sd-scripts' docs suggest about 4. Chroma has no guidance input
(diffusers' ChromaTransformer2DModel feeds its approximator a guidance of 0, the value sd-scripts' docs ask
for with `--g 0`), so a non-zero `--g` is ignored with one warning and the image records guidance 0.
Defaults 512x512 and 20 steps; each image's start noise comes from its own CPU generator.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from library.core.errors import warn_once
from library.families.base import Components, ModelFamily, TextConditioning
from library.families.flux.generate import flux_sigmas
from library.families.common.flow_sampling import decode_images, encode_prompts_flux, euler_sample, initial_noise, prompts_then_negatives, resolve_batch, resolve_flow_request
from library.sampling.generate import GeneratedImage

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 512
DEFAULT_STEPS = 20
DEFAULT_SCALE = 1.0  # sd-scripts' default: no negative pass
GUIDANCE = 0.0  # what the model's approximator is fed, always
SIZE_MULTIPLE = 16  # VAE factor 8 times the 2x2 patch packing
MIN_SIZE = 64


def resolve_chroma_request(request):
    """The request with Chroma's defaults filled in, guidance 0 and the size rounded down to a multiple of 16."""
    if request.guidance not in (None, GUIDANCE):
        warn_once(logger, f"guidance {request.guidance:g} (--g) is ignored for Chroma: the model has no guidance "
                          "input; use --l for classifier-free guidance")
    request = dataclasses.replace(request, guidance=None)
    return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE,
                                guidance=GUIDANCE)


def chroma_sigmas(steps: int, image_tokens: int) -> torch.Tensor:
    """steps + 1 σ from 1 to 0, shifted for `image_tokens` packed patches (sd-scripts shifts for Chroma too)."""
    return flux_sigmas(steps, image_tokens, shift=True)


@torch.no_grad()
def generate_chroma(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    from PIL import Image

    resolved = resolve_batch(requests, resolve_chroma_request, "generate_chroma")
    first = resolved[0]
    model = components.denoiser
    use_cfg = first.scale != 1.0
    texts = prompts_then_negatives(resolved, use_cfg)
    text = encode_prompts_flux(family, components, texts, device)
    text = TextConditioning(tensors={k: v.to(device) for k, v in text.tensors.items()})

    latents = initial_noise(family, resolved, device)
    h, w = latents.shape[-2:]

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)  # predict's unit: σ·1000
        return family.predict(components, model_in.to(model.dtype), timesteps, text, {})

    latents = euler_sample(latents, chroma_sigmas(first.steps, (h // 2) * (w // 2)), velocity, first.scale, use_cfg)
    images = decode_images(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
