"""Sampling pieces every flow-matching family shares: request defaults, the seeded start noise, Euler steps with
classifier-free guidance, prompt encoding and autoencoder decoding with modules borrowed onto the device, and
`generate_flow`, the whole text-to-image loop of a family whose denoiser runs through `family.predict`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Optional

import numpy as np
import torch

from library.core.errors import warn_once
from library.families.base import Components, ModelFamily, TextConditioning
from library.sampling.generate import GeneratedImage
from library.sampling.samplers import sampler_spec

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def borrowed_on(module: torch.nn.Module, device: torch.device):
    """Run `module` on `device` for the block, then put it back where it lived.

    With cached text-encoder outputs an encoder may live elsewhere (CPU); sampling borrows it.
    """
    home = next(module.parameters()).device
    moved = home != torch.device(device)
    if moved:
        module.to(device)
    try:
        yield module
    finally:
        if moved:
            module.to(home)


DEFAULT_SAMPLER = "flow_euler"


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


@torch.no_grad()
def encode_control_images(family: ModelFamily, vae: torch.nn.Module, paths, width: int, height: int,
                          device: torch.device) -> list[torch.Tensor]:
    """Edit models' reference images for generation: each file resized to cover (width, height) and centre-cropped
    to it (as training resizes a control image to its target's bucket), encoded and scaled: one (1, C, h, w) each."""
    from PIL import Image, ImageOps

    out = []
    for path in paths:
        with Image.open(path) as image:
            image = ImageOps.fit(ImageOps.exif_transpose(image).convert("RGB"), (width, height), Image.LANCZOS)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]
        latents = family.encode_images(vae, pixels.to(device, vae.dtype), torch.Generator("cpu").manual_seed(0))
        out.append(family.scale_latents(latents.float()))
    return out


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
                 scale: float, guided: bool,
                 after_step: Optional[Callable[[torch.Tensor, float], torch.Tensor]] = None) -> torch.Tensor:
    """Euler steps of a flow model over `sigmas` (σ from 1 to 0). `velocity(model_in, σ)` is the model's
    prediction; `guided`: the batch is run with its negatives after it (classifier-free guidance at `scale`).
    `after_step(latents, σ_next)`: what the latents become after each step (inpainting's blend)."""
    n = latents.shape[0]
    for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        model_in = torch.cat([latents, latents]) if guided else latents
        v = velocity(model_in, sigma).float()
        if guided:
            cond, uncond = v[:n], v[n:]
            v = uncond + scale * (cond - uncond)
        latents = latents + (sigma_next - sigma) * v
        if after_step is not None:
            latents = after_step(latents, sigma_next)
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
def encode_negatives_apart(family: ModelFamily, components: Components, resolved: list, use_cfg: bool,
                           device: torch.device, tokenize_negatives: Optional[Callable[[list[str]], dict]] = None
                           ) -> TextConditioning:
    """Prompts and (with guidance) negatives encoded as two batches by the one text encoder, borrowed onto `device`,
    then joined: for a family whose negatives are tokenized their own way (`tokenize_negatives`; Lumina's carry no
    system prompt) or encoded apart as its reference pipeline does (Z-Image's)."""
    with borrowed_on(components.text_encoders[0], device):
        text = family.encode_text(components, family.tokenize(components, [r.prompt for r in resolved], None), None)
        if use_cfg:
            negatives = [r.negative_prompt or "" for r in resolved]
            tokens = (tokenize_negatives(negatives) if tokenize_negatives is not None
                      else family.tokenize(components, negatives, None))
            negative = family.encode_text(components, tokens, None)
            text = TextConditioning({k: torch.cat([text.tensors[k], negative.tensors[k]]) for k in text.tensors})
    return text


@torch.no_grad()
def generate_flow(family: ModelFamily, components: Components, requests: list, device: torch.device, *,
                  resolve: Callable, name: str, sigmas: Callable[[object, torch.Tensor], torch.Tensor],
                  encode: Optional[Callable[[list, bool], TextConditioning]] = None) -> list[GeneratedImage]:
    """Denoise one batch of requests that share size, steps, scale and sampler, as a flow family samples.

    `resolve(request)` fills in the family's defaults (`name` is said when the batch cannot run together);
    `sigmas(first_request, start_latents)` is its σ schedule, 1 to 0; `encode(resolved, use_cfg)` its text
    conditioning of the prompts, then (with guidance) the negatives; by default the family's own tokenizing and
    encoding of all of them in one batch, with every text encoder borrowed onto `device`. The guided pass runs
    when the scale is not 1; the denoiser runs through `family.predict` at timesteps σ·1000."""
    from PIL import Image

    resolved = resolve_batch(requests, resolve, name)
    first = resolved[0]
    use_cfg = first.scale != 1.0
    if encode is None:
        text = encode_prompts_flux(family, components, prompts_then_negatives(resolved, use_cfg), device)
    else:
        text = encode(resolved, use_cfg)
    text = TextConditioning({k: v.to(device) for k, v in text.tensors.items()})
    model = components.denoiser
    latents = initial_noise(family, resolved, device)

    def velocity(model_in: torch.Tensor, sigma: float) -> torch.Tensor:
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)  # predict's unit: σ·1000
        return family.predict(components, model_in.to(model.dtype), timesteps, text, {})

    latents = euler_sample(latents, sigmas(first, latents), velocity, first.scale, use_cfg)
    images = decode_images(family, components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]
