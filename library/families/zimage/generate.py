"""Image generation for Z-Image, as diffusers' ZImagePipeline: Qwen3 text through the chat template (the same for
the negative prompt), classifier-free guidance when the scale is not 1 (Turbo is sampled without: --l 1; Base with),
flow-match Euler on a schedule of `steps` σ evenly from 1, shifted by --sample_shift (default 3.0, the scheduler
config Tongyi-MAI ships: FlowMatchEulerDiscreteScheduler(shift=3.0), no dynamic shifting), then 0.

Defaults: 8 steps (Z-Image-Turbo's), scale 1.0 (no guidance, as Turbo), 1024x1024 rounded to multiples of 16.
Each image's start noise comes from its own CPU generator.
"""

from __future__ import annotations

import torch

from library.families.base import Components, ModelFamily
from library.families.common.flow_sampling import encode_negatives_apart, generate_flow, resolve_flow_request
from library.objectives.flow import shift_sigmas

DEFAULT_SIZE = 1024
DEFAULT_STEPS = 8
DEFAULT_SCALE = 1.0
SIZE_MULTIPLE = 16
MIN_SIZE = 64


def resolve_zimage_request(request):
    """The request with Z-Image's defaults filled in and the size rounded down to a multiple of 16."""
    return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE)


def zimage_sigmas(steps: int, shift: float) -> torch.Tensor:
    """steps + 1 σ: `steps` values evenly from 1 to 1/steps, shifted by `shift`, then 0 (the scheduler's)."""
    t = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    return torch.cat([shift_sigmas(t, shift), torch.zeros(1, dtype=torch.float64)]).float()


def generate_zimage(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler; the negatives are encoded apart
    from the prompts, as ZImagePipeline does."""
    shift = family.options(components).sample_shift
    return generate_flow(
        family, components, requests, device, resolve=resolve_zimage_request, name="generate_zimage",
        sigmas=lambda first, latents: zimage_sigmas(first.steps, shift),
        encode=lambda resolved, use_cfg: encode_negatives_apart(family, components, resolved, use_cfg, device))
