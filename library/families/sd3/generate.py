"""Image generation for SD3 / SD3.5: CLIP-L + CLIP-G + T5 text, classifier-free guidance, flow-match Euler.

As sd-scripts samples SD3 during training: σ from 1 down to the schedule's smallest σ on the
shift-3 schedule (timesteps spaced evenly, then shifted), then 0; one Euler step per σ on the
guided velocity; defaults 30 steps, scale 7.5, 512x512. Each image's start noise comes from its
own CPU generator. The guided pass with the negative prompt runs when the scale is not 1.
"""

from __future__ import annotations

import torch

from library.families.base import Components, ModelFamily, TextConditioning
from library.families.common.flow_sampling import decode_images, encode_prompts_flux, euler_sample, initial_noise, prompts_then_negatives, resolve_batch, resolve_flow_request
from library.objectives.flow import shift_sigmas
from library.sampling.generate import GeneratedImage

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


@torch.no_grad()
def generate_sd3(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    from PIL import Image

    resolved = resolve_batch(requests, resolve_sd3_request, "generate_sd3")
    first = resolved[0]
    model = components.denoiser
    use_cfg = first.scale != 1.0
    texts = prompts_then_negatives(resolved, use_cfg)
    text = encode_prompts_flux(family, components, texts, device)
    text = TextConditioning(tensors={k: v.to(device) for k, v in text.tensors.items()})

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)
        return family.predict(components, model_in.to(model.dtype), timesteps, text, {})

    latents = euler_sample(initial_noise(family, resolved, device), sd3_sigmas(first.steps), velocity, first.scale, use_cfg)
    images = decode_images(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
