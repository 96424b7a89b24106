"""Image generation for FLUX.1: CLIP-L + T5 text, guidance, and a flow-match Euler loop.

Not the DDPM loop of SD/SDXL (`sd_generate.generate_ddpm`): a rectified-flow model
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

import contextlib
import dataclasses
import logging
from typing import Callable, Optional

import numpy as np
import torch

from library.core.errors import warn_once
from library.families.base import Components, ModelFamily, TextConditioning
from library.families.sd.generate import borrowed_on
from library.objectives.flow import flux_shift_mu, time_shift
from library.sampling.generate import GeneratedImage
from library.sampling.samplers import sampler_spec

logger = logging.getLogger(__name__)

# sd-scripts' FLUX.1 sampling defaults.
DEFAULT_SIZE = 512
DEFAULT_STEPS = 20
DEFAULT_GUIDANCE = 3.5
DEFAULT_SCALE = 1.0
DEFAULT_SAMPLER = "flow_euler"
SIZE_MULTIPLE = 16  # VAE factor 8 times the 2x2 patch packing
MIN_SIZE = 64



def _flow_sampler(name: Optional[str]) -> str:
    """The request's sampler when it is a flow sampler, else flow_euler (with one warning per name).

    sd-scripts ignores --sample_sampler for FLUX.1; a DDPM sampler name (say from a shared
    prompt file) is therefore replaced rather than an error in the middle of training.
    """
    if not name:
        return DEFAULT_SAMPLER
    spec = sampler_spec(name)
    if spec.kind == "flow":
        return spec.name
    warn_once(logger, f"sampler {name!r} does not apply to FLUX.1 (a flow model); using {DEFAULT_SAMPLER}")
    return DEFAULT_SAMPLER


def resolve_flow_request(request, size: int, steps: int, scale: float, multiple: int = 16, min_size: int = 64,
                         **defaults):
    """A flow model's request with its defaults filled in (`size`, `steps`, `scale`, and any other field named in
    `defaults` that the request leaves None), the size rounded down to a multiple of `multiple` (at least
    `min_size`), and a flow sampler."""
    def side(value: Optional[int]) -> int:
        value = value or size
        return max(min_size, value - value % multiple)

    others = {k: v if getattr(request, k) is None else getattr(request, k) for k, v in defaults.items()}
    return dataclasses.replace(request, width=side(request.width), height=side(request.height),
                               steps=request.steps or steps, scale=scale if request.scale is None else request.scale,
                               sampler=_flow_sampler(request.sampler), **others)


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
def encode_prompts_flux(family: ModelFamily, components: Components, texts: list[str],
                        device: torch.device) -> TextConditioning:
    """The family's own tokenizing and encoding (as training), with every text encoder borrowed onto `device`
    (FLUX.1's CLIP-L and T5, Chroma's T5, SD3's three)."""
    tokens = family.tokenize(components, texts, None)
    with contextlib.ExitStack() as stack:
        for encoder in components.text_encoders:
            stack.enter_context(borrowed_on(encoder, device))
        return family.encode_text(components, tokens, None)


def decode_images(family: ModelFamily, vae: torch.nn.Module, latents: torch.Tensor) -> np.ndarray:
    """AE-normalised latents -> uint8 images (B, H, W, 3): undo (x - shift)·scale, decode, clamp."""
    config = getattr(vae, "config", None)
    scale = getattr(config, "scaling_factor", None) or family.ae_scale
    shift = getattr(config, "shift_factor", None)
    latents = latents / scale + (family.ae_shift if shift is None else shift)
    with borrowed_on(vae, latents.device):  # with cached latents the AE waits in CPU memory
        pixels = vae.decode(latents.to(latents.device, vae.dtype)).sample.float()
    if not torch.isfinite(pixels).all():
        logger.warning("generated image has NaN/inf values (fp16 overflow?); they are drawn black. Try bf16")
        pixels = torch.nan_to_num(pixels, nan=-1.0, posinf=1.0, neginf=-1.0)
    pixels = ((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return (pixels * 255).round().astype(np.uint8)


def initial_noise(family: ModelFamily, requests: list, device: torch.device) -> torch.Tensor:
    """Each request's starting latents from its own seed (float32, so the Euler sum stays exact whatever the model
    dtype); all requests share the first one's size."""
    first = requests[0]
    generators = [torch.Generator("cpu").manual_seed(r.seed) for r in requests]
    h, w = first.height // family.vae_scale_factor, first.width // family.vae_scale_factor
    return torch.stack([torch.randn((family.latent_channels, h, w), generator=g) for g in generators]).to(device)


def euler_sample(latents: torch.Tensor, sigmas: torch.Tensor, velocity: Callable[[torch.Tensor, float], torch.Tensor],
                 scale: float, guided: bool) -> torch.Tensor:
    """Euler steps of a flow model over `sigmas` (σ from 1 to 0). `velocity(model_in, σ)` is the model's
    prediction; `guided`: the batch is run with its negatives after it (classifier-free guidance at `scale`)."""
    n = latents.shape[0]
    for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        model_in = torch.cat([latents, latents]) if guided else latents
        v = velocity(model_in, sigma).float()
        if guided:
            cond, uncond = v[:n], v[n:]
            v = uncond + scale * (cond - uncond)
        latents = latents + (sigma_next - sigma) * v
    return latents


def resolve_batch(requests: list, resolve, name: str, shared: str = "size, steps, scale and sampler") -> list:
    """The requests with the family's defaults filled in (`resolve`); ValueError naming `name` unless they can
    run as one batch (the same batch_key: what `shared` lists)."""
    resolved = [resolve(r) for r in requests]
    if any(r.batch_key() != resolved[0].batch_key() for r in resolved):
        raise ValueError(f"{name}: a batch must share {shared}")
    return resolved


def prompts_then_negatives(resolved: list, use_cfg: bool) -> list[str]:
    """The texts to encode for one batch: every prompt, then (with classifier-free guidance) every negative."""
    return [r.prompt for r in resolved] + ([r.negative_prompt or "" for r in resolved] if use_cfg else [])


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

    latents = initial_noise(family, resolved, device)
    h, w = latents.shape[-2:]
    sigmas = flux_sigmas(first.steps, (h // 2) * (w // 2), shift=bool(model.config.guidance_embeds))

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)  # predict's unit: σ·1000
        return family.predict(components, model_in.to(model.dtype), timesteps, text, batch)

    latents = euler_sample(latents, sigmas, velocity, first.scale, use_cfg)

    images = decode_images(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
