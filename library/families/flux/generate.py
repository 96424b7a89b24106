"""Image generation for FLUX.1: CLIP-L + T5 text, guidance, and a flow-match Euler loop.

Not the DDPM loop of SD/SDXL (`sd/generate.py` generate_ddpm): a rectified-flow model
predicts a velocity v, and one Euler step is x_next = x + (σ_next - σ)·v on a σ
schedule from 1 (noise) to 0 (image). For a guidance-distilled model (dev) the σ
are shifted by the image's token count, as diffusers' FluxPipeline and sd-scripts
sample; schnell uses the plain linear schedule, as they do.

Each image's start noise comes from its own CPU generator, so an image does not
depend on its batch or device. `--g` (request.guidance, default 3.5) is fed to the
transformer's guidance embedding; `--l` (request.scale, default 1.0) is true CFG
with a second, negative-prompt pass, run only when the scale is above 1.
Prompts are read as they are: `(word:1.2)` weighting applies to the CLIP families only.
"""

from __future__ import annotations

import logging

import torch

from library.families.base import Components, ModelFamily, TextConditioning
from library.objectives.flow import flux_shift_mu, time_shift
from library.sampling.generate import GeneratedImage, control_image_rows
from library.sampling.img2img import flow_blend, flow_start, latent_masks
from library.families.common.flow_sampling import borrowed_on, decode_images, encode_control_images, encode_prompts_flux, euler_sample, initial_noise, prompts_then_negatives, resolve_batch, resolve_flow_request

logger = logging.getLogger(__name__)

# sd-scripts' FLUX.1 sampling defaults.
DEFAULT_SIZE = 512
DEFAULT_STEPS = 20
DEFAULT_GUIDANCE = 3.5
DEFAULT_SCALE = 1.0
SIZE_MULTIPLE = 16  # VAE factor 8 times the 2x2 patch packing
MIN_SIZE = 64


def resolve_flux_request(request):
    """The request with FLUX.1's defaults filled in and the size rounded down to a multiple of 16."""
    return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE,
                                guidance=DEFAULT_GUIDANCE)


def flux_sigmas(steps: int, image_tokens: int, shift: bool) -> torch.Tensor:
    """steps + 1 σ from 1 down to 0, time-shifted for `image_tokens` packed patches when `shift`."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    if shift:
        # time_shift(σ=0) is e^μ / inf = 0: the last σ stays exactly 0.
        sigmas = time_shift(flux_shift_mu(image_tokens), sigmas)
    return sigmas.float()


@torch.no_grad()
def generate_flux(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale, guidance and sampler."""
    from PIL import Image


    resolved = resolve_batch(requests, resolve_flux_request, "generate_flux",
                             "size, steps, scale, guidance and sampler")
    first = resolved[0]
    model = components.denoiser
    use_cfg = first.scale > 1.0
    texts = prompts_then_negatives(resolved, use_cfg)
    text = encode_prompts_flux(family, components, texts, device)
    text = TextConditioning(tensors={k: v.to(device) for k, v in text.tensors.items()})
    batch = {"guidance": torch.full((len(texts),), float(first.guidance), device=device)}
    control = control_image_rows(resolved, len(texts))  # prompts then negatives, as `texts`
    if control is not None:
        batch["conditioning_images"] = control.to(device)

    latents = initial_noise(family, resolved, device)
    h, w = latents.shape[-2:]
    sigmas = flux_sigmas(first.steps, (h // 2) * (w // 2), shift=bool(model.config.guidance_embeds))
    # FLUX.1 Kontext: the reference image(s), at the output's size, as extra tokens (family.kontext_tokens)
    controls = encode_control_images(family, components.vae, first.control_images, first.width, first.height, device)

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)  # predict's unit: σ·1000
        batch["scaled_control_latents"] = [c.expand(model_in.shape[0], -1, -1, -1) for c in controls]
        return family.predict(components, model_in.to(model.dtype), timesteps, text, batch)

    # img2img / inpainting (gen_img's --image_path, --strength, --mask_path: library/sampling/img2img.py)
    inputs = [getattr(r, "image_input", None) for r in resolved]

    def encode(pixels: torch.Tensor) -> torch.Tensor:  # each image's posterior sample from its own seed
        posterior = [torch.Generator("cpu").manual_seed(r.seed) for r in resolved]
        with borrowed_on(components.vae, device):
            return family.encode_images(components.vae, pixels.to(device), generator=posterior)

    noise = latents
    latents, sigmas, init = flow_start(inputs, encode, noise, sigmas, family.vae_scale_factor)
    mask = latent_masks(inputs, (h, w), device)
    blend = None if mask is None else (lambda x, sigma: flow_blend(x, init, noise, mask, sigma))
    latents = euler_sample(latents, sigmas, velocity, first.scale, use_cfg, after_step=blend)

    images = decode_images(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
