"""Image generation for Lumina Image 2.0: Gemma-2 text (system prompt on the prompt, none on the negative, as
sd-scripts), classifier-free guidance, flow-match Euler on the --discrete_flow_shift schedule (default 6.0).

Defaults: 30 steps, scale 4.0, 1024x1024 rounded to multiples of 16. Each image's start noise comes from its own CPU
generator; the negative pass runs when the scale is not 1.
"""

from __future__ import annotations

import torch

from library.families.base import Components, ModelFamily
from library.families.common.flow_sampling import encode_negatives_apart, generate_flow, resolve_flow_request
from library.objectives.flow import shift_sigmas

DEFAULT_SIZE = 1024
DEFAULT_STEPS = 30
DEFAULT_SCALE = 4.0
SIZE_MULTIPLE = 16
MIN_SIZE = 64


def resolve_lumina_request(request):
    """The request with Lumina's defaults filled in and the size rounded down to a multiple of 16."""
    return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE)


def lumina_sigmas(steps: int, shift: float) -> torch.Tensor:
    """steps + 1 σ: `steps` values evenly from 1 to 1/steps, shifted by `shift`, then 0."""
    t = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    return torch.cat([shift_sigmas(t, shift), torch.zeros(1, dtype=torch.float64)]).float()


def generate_lumina(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler; the negatives are tokenized without
    the system prompt, as sd-scripts does."""
    shift = family.options(components).flow.discrete_flow_shift
    return generate_flow(
        family, components, requests, device, resolve=resolve_lumina_request, name="generate_lumina",
        sigmas=lambda first, latents: lumina_sigmas(first.steps, shift),
        encode=lambda resolved, use_cfg: encode_negatives_apart(
            family, components, resolved, use_cfg, device,
            tokenize_negatives=lambda texts: family.tokenize_plain(components, texts)))
