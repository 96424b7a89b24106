"""Image generation for Z-Image, as diffusers' ZImagePipeline: Qwen3 text through the chat template (the same for
the negative prompt), classifier-free guidance when the scale is not 1 (Turbo is sampled without: --l 1; Base with),
flow-match Euler on a schedule of `steps` σ evenly from 1, shifted by --sample_shift (default 3.0, the scheduler
config Tongyi-MAI ships: FlowMatchEulerDiscreteScheduler(shift=3.0), no dynamic shifting), then 0.

Defaults: 8 steps (Z-Image-Turbo's), scale 1.0 (no guidance, as Turbo), 1024x1024 rounded to multiples of 16.
Each image's start noise comes from its own CPU generator.
"""

from __future__ import annotations

import torch

from library.families.base import Components, ModelFamily, TextConditioning
from library.families.common.flow_sampling import (
    borrowed_on,
    decode_images,
    euler_sample,
    initial_noise,
    resolve_batch,
    resolve_flow_request,
)
from library.objectives.flow import shift_sigmas
from library.sampling.generate import GeneratedImage

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


@torch.no_grad()
def generate_zimage(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    from PIL import Image

    resolved = resolve_batch(requests, resolve_zimage_request, "generate_zimage")
    first = resolved[0]
    use_cfg = first.scale != 1.0
    encoder = components.text_encoders[0]
    with borrowed_on(encoder, device):
        text = family.encode_text(components, family.tokenize(components, [r.prompt for r in resolved], None), None)
        if use_cfg:
            negative = family.encode_text(components, family.tokenize(
                components, [r.negative_prompt or "" for r in resolved], None), None)
            text = TextConditioning({k: torch.cat([text.tensors[k], negative.tensors[k]]) for k in text.tensors})
    text = TextConditioning({k: v.to(device) for k, v in text.tensors.items()})
    model = components.denoiser

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)
        return family.predict(components, model_in.to(model.dtype), timesteps, text, {})

    sigmas = zimage_sigmas(first.steps, family.options(components).sample_shift)
    latents = euler_sample(initial_noise(family, resolved, device), sigmas, velocity, first.scale, use_cfg)
    images = decode_images(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
