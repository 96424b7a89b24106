"""Image generation for HunyuanImage 2.1: Qwen2.5-VL + byT5 text, classifier-free guidance, flow-match Euler on
sd-scripts' schedule (σ evenly from 1 to 0 in `steps`, shifted by --discrete_flow_shift, default 5.0).

Defaults as sd-scripts' sample images: 20 steps, scale 3.5, 512x512 (rounded down to multiples of 32, the VAE's
stride). sd-scripts' sampler adds adaptive projected guidance (APG) to CFG; this one is plain CFG.
"""

from __future__ import annotations

import torch

from library.families.base import Components, ModelFamily
from library.families.common.flow_sampling import generate_flow, resolve_flow_request
from library.objectives.flow import shift_sigmas

DEFAULT_SIZE = 512
DEFAULT_STEPS = 20
DEFAULT_SCALE = 3.5
SIZE_MULTIPLE = 32
MIN_SIZE = 64


def resolve_hunyuan_image_request(request):
    """The request with HunyuanImage's defaults filled in and the size rounded down to a multiple of 32."""
    return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE)


def hunyuan_image_sigmas(steps: int, shift: float) -> torch.Tensor:
    """steps + 1 σ: linspace(1, 0) shifted by `shift` (sd-scripts' get_timesteps_sigmas)."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift).float()


def generate_hunyuan_image(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler (both text encoders borrowed)."""
    shift = family.options(components).flow.discrete_flow_shift
    return generate_flow(family, components, requests, device, resolve=resolve_hunyuan_image_request,
                         name="generate_hunyuan_image",
                         sigmas=lambda first, latents: hunyuan_image_sigmas(first.steps, shift))
