"""Image generation for SD3 / SD3.5: CLIP-L + CLIP-G + T5 text, classifier-free guidance, flow-match Euler.

As sd-scripts samples SD3 during training: σ from 1 down to the schedule's smallest σ on the
shift-3 schedule (timesteps spaced evenly, then shifted), then 0; one Euler step per σ on the
guided velocity; defaults 30 steps, scale 7.5, 512x512. Each image's start noise comes from its
own CPU generator. The guided pass with the negative prompt runs when the scale is not 1.
"""

from __future__ import annotations

import torch

from library.families.base import Components, ModelFamily
from library.families.common.flow_sampling import generate_flow, resolve_flow_request
from library.objectives.flow import shift_sigmas

DEFAULT_SIZE = 512
DEFAULT_STEPS = 30
DEFAULT_SCALE = 7.5
SAMPLING_SHIFT = 3.0  # sd-scripts' ModelSamplingDiscreteFlow(shift=3.0) "for SD3"
SIZE_MULTIPLE = 16  # VAE factor 8 times the 2x2 patches
MIN_SIZE = 64


def resolve_sd3_request(request):
    """The request with SD3's defaults filled in and the size rounded down to a multiple of 16."""
    return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE)


def sd3_sigmas(steps: int, shift: float = SAMPLING_SHIFT) -> torch.Tensor:
    """steps + 1 σ: the shifted schedule at `steps` timesteps evenly spaced from 1000 to its smallest, then 0."""
    smallest = float(shift_sigmas(torch.tensor(1 / 1000, dtype=torch.float64), shift))
    t = torch.linspace(1.0, smallest, steps, dtype=torch.float64)
    return torch.cat([shift_sigmas(t, shift), torch.zeros(1, dtype=torch.float64)]).float()


def generate_sd3(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    return generate_flow(family, components, requests, device, resolve=resolve_sd3_request, name="generate_sd3",
                         sigmas=lambda first, latents: sd3_sigmas(first.steps))
