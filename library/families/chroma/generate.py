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
from library.families.base import Components, ModelFamily
from library.families.flux.generate import flux_sigmas
from library.families.common.flow_sampling import generate_flow, resolve_flow_request

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


def generate_chroma(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    def sigmas(first, latents: torch.Tensor) -> torch.Tensor:
        h, w = latents.shape[-2:]
        return chroma_sigmas(first.steps, (h // 2) * (w // 2))

    return generate_flow(family, components, requests, device, resolve=resolve_chroma_request,
                         name="generate_chroma", sigmas=sigmas)
