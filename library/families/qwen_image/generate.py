"""Image generation for Qwen-Image as diffusers' QwenImagePipeline does it: Qwen2.5-VL text, true classifier-free
guidance with the pipeline's norm rescale (the guided velocity scaled back to the conditional one's norm), and
flow-match Euler on Qwen/Qwen-Image's scheduler (σ from 1 to 1/steps, exponential time shift by image size with
base_shift 0.5 / max_shift 0.9 over 256..8192 tokens, stretched to end at 0.02, then 0).

Defaults as the pipeline: 50 steps, scale 4.0 (true_cfg_scale), sizes in multiples of 16.

Qwen-Image-Edit (--model_version edit*) as QwenImageEditPlusPipeline / QwenImageEditPipeline: the control images
(--control_image / --ci) go to Qwen2.5-VL with the prompt and the negative prompt (text.vl_image: ~384² each for
2509 / 2511, ~1024² for Edit) and, each resized to about 1024² pixels at its own aspect ratio (sides multiples of
32, Lanczos), through the VAE (the posterior's mode), packed after the noise tokens (family.predict). The output
size is the request's (default 1024²), not the pipeline's size taken from the last control image.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from library.core.errors import ConfigError
from library.families.base import Components, ModelFamily, TextConditioning
from library.families.common.flow_sampling import borrowed_on, prompts_then_negatives, resolve_batch, resolve_flow_request
from library.sampling.generate import GeneratedImage

DEFAULT_SIZE = 1024
DEFAULT_STEPS = 50
DEFAULT_SCALE = 4.0
SIZE_MULTIPLE = 16
MIN_SIZE = 16
# Qwen/Qwen-Image scheduler/scheduler_config.json
BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT, SHIFT_TERMINAL = 256, 8192, 0.5, 0.9, 0.02


def qwen_image_sigmas(steps: int, image_tokens: int) -> torch.Tensor:
    """steps + 1 σ of the pipeline's scheduler for an image of `image_tokens` packed tokens."""
    m = (MAX_SHIFT - BASE_SHIFT) / (MAX_SEQ - BASE_SEQ)
    mu = image_tokens * m + BASE_SHIFT - m * BASE_SEQ
    sigmas = np.linspace(1.0, 1.0 / steps, steps)
    sigmas = math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))
    one_minus = 1.0 - sigmas
    sigmas = 1.0 - one_minus / (one_minus[-1] / (1.0 - SHIFT_TERMINAL))
    return torch.tensor(np.append(sigmas, 0.0), dtype=torch.float32)


@torch.no_grad()
def generate_qwen_image(family: ModelFamily, components: Components, requests: list, device: torch.device) -> list:
    """Denoise one batch of requests that share size, steps, scale and sampler."""
    from PIL import Image

    def resolve(request):
        return resolve_flow_request(request, DEFAULT_SIZE, DEFAULT_STEPS, DEFAULT_SCALE, SIZE_MULTIPLE, MIN_SIZE)

    resolved = resolve_batch(requests, resolve, "generate_qwen_image")
    first = resolved[0]
    use_cfg = first.scale > 1.0
    texts = prompts_then_negatives(resolved, use_cfg)
    options = family.options(components)
    controls = tuple(first.control_images or ())
    if controls and not options.is_edit:
        raise ConfigError(f"--control_image: Qwen-Image takes control images with --model_version edit, edit-2509 or "
                          f"edit-2511 (got {len(controls)})")
    if len(controls) > options.max_controls > 0:
        raise ConfigError(f"--control_image: {len(controls)} control images; Qwen-Image-Edit ({options.version}) "
                          f"takes at most {options.max_controls}")
    texts = [family.text_key(components, t, controls) for t in texts]
    qwen, = components.text_encoders
    with borrowed_on(qwen, device):
        text = family.encode_text(components, family.tokenize(components, texts, None), None)
    text = TextConditioning({k: v.to(device) for k, v in text.tensors.items()})
    model = components.denoiser
    n = len(resolved)
    h, w = first.height // family.vae_scale_factor, first.width // family.vae_scale_factor
    generators = [torch.Generator("cpu").manual_seed(r.seed) for r in resolved]
    latents = torch.stack([torch.randn((family.latent_channels, h, w), generator=g) for g in generators]).to(device)
    references = [family.scale_latents(c).to(device) for c in encode_edit_controls(components.vae, controls, device)]
    sigmas = qwen_image_sigmas(first.steps, (h // 2) * (w // 2))
    for sigma, sigma_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        model_in = torch.cat([latents, latents]) if use_cfg else latents
        timesteps = torch.full((model_in.shape[0],), sigma * 1000, device=device)
        batch = {"scaled_control_latents": [r.expand(model_in.shape[0], -1, -1, -1).to(model.dtype)
                                             for r in references]} if references else {}
        v = family.predict(components, model_in.to(model.dtype), timesteps, text, batch).float()
        if use_cfg:
            cond, uncond = v[:n], v[n:]
            guided = uncond + first.scale * (cond - uncond)
            # the pipeline's rescale: per token (packed 2x2 patch) to the conditional prediction's norm
            v = family.rescale_guided(guided, cond)
        latents = latents + (sigma_next - sigma) * v
    images = family.decode_latents(components.vae, latents)
    return [GeneratedImage(Image.fromarray(img), r) for img, r in zip(images, resolved)]


@torch.no_grad()
def encode_edit_controls(vae, paths, device: torch.device) -> list[torch.Tensor]:
    """Unscaled latents (1, 16, h, w) of each control image as QwenImageEditPlusPipeline encodes it: RGB, resized to
    about 1024² pixels at its own aspect ratio (calculate_dimensions; VaeImageProcessor.preprocess, Lanczos, to
    [-1, 1]), the VAE posterior's mode."""
    if not paths:
        return []
    from diffusers.image_processor import VaeImageProcessor

    from library.families.common.flow_sampling import borrowed_on
    from library.families.qwen_image.text import VAE_AREA, calculate_dimensions, read_control

    processor = VaeImageProcessor(vae_scale_factor=16)
    out = []
    with borrowed_on(vae, device):
        for path in paths:
            image = read_control(path)
            width, height = calculate_dimensions(VAE_AREA, image.size[0] / image.size[1])
            pixels = processor.preprocess(image, height, width).to(device, vae.dtype)
            out.append(vae.encode(pixels[:, :, None]).latent_dist.mode()[:, :, 0].float())
    return out
