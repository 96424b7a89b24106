"""Image generation for HunyuanImage 2.1: Qwen2.5-VL + byT5 text, classifier-free guidance, flow-match Euler on
sd-scripts' schedule (σ evenly from 1 to 0 in `steps`, shifted by --discrete_flow_shift, default 5.0).

Defaults as sd-scripts' sample images: 20 steps, scale 3.5, 512x512 (rounded down to multiples of 32, the VAE's
stride). sd-scripts' sampler adds adaptive projected guidance (APG) to CFG; this one is plain CFG.
"""

from __future__ import annotations

import torch

from library.families.base import Components, ModelFamily, TextConditioning
from library.families.common.flow_sampling import decode_images, euler_sample, initial_noise, prompts_then_negatives, resolve_batch, resolve_flow_request
from library.families.common.flow_sampling import borrowed_on
from library.objectives.flow import shift_sigmas
from library.sampling.generate import GeneratedImage

DEFAULT_SIZE = 512
DEFAULT_STEPS = 20
DEFAULT_SCALE = 3.5
SIZE_MULTIPLE = 32
MIN_SIZE = 64


def hunyuan_image_sigmas(steps: int, shift: float) -> torch.Tensor:
    """steps + 1 σ: linspace(1, 0) shifted by `shift` (sd-scripts' get_timesteps_sigmas)."""
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift).float()


@torch.no_grad()
def generate_hunyuan_image(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    from PIL import Image

    def resolve(request):
        return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE)

    resolved = resolve_batch(requests, resolve, "generate_hunyuan_image")
    first = resolved[0]
    use_cfg = first.scale != 1.0
    texts = prompts_then_negatives(resolved, use_cfg)
    qwen, byt5 = components.text_encoders
    with borrowed_on(qwen, device), borrowed_on(byt5, device):
        text = family.encode_text(components, family.tokenize(components, texts, None), None)
    text = TextConditioning({k: v.to(device) for k, v in text.tensors.items()})
    model = components.denoiser

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)
        return family.predict(components, model_in.to(model.dtype), timesteps, text, {})

    sigmas = hunyuan_image_sigmas(first.steps, family.options(components).flow.discrete_flow_shift)
    latents = euler_sample(initial_noise(family, resolved, device), sigmas, velocity, first.scale, use_cfg)
    images = decode_images(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
