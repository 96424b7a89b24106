"""Generation with networks conditioned on an image (ControlNet-LLLite: `set_cond_image`), for tools/generate.py and
sampling during training: the requests are generated in groups of one control image (a prompt's --cn, or
--control_image), the image set on the networks, at the size of the image being denoised, before every denoiser
call. Networks without `set_cond_image` and requests without a control image generate as before."""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from library.sampling.generate import GeneratedImage, GenerationRequest, generate_images


def image_networks(networks: Sequence) -> list:
    """The networks that take a conditioning image."""
    return [n for n in networks if hasattr(n, "set_cond_image")]


@contextlib.contextmanager
def control_image_set(networks: Sequence, denoiser: torch.nn.Module, path: Optional[str], vae_scale_factor: int):
    """Inside: before every call of `denoiser`, each network gets the control image at `path` as RGB in [-1, 1],
    resized (LANCZOS, as sd-scripts' gen_img) to the pixel size of the latents denoised; None: no control."""
    if path is None:
        for network in networks:
            network.set_cond_image(None)
        yield
        return
    import numpy as np
    from PIL import Image

    with Image.open(path) as opened:
        image = opened.convert("RGB")
    resized: dict[tuple[int, int], torch.Tensor] = {}

    def before(module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        h, w = sample.shape[-2] * vae_scale_factor, sample.shape[-1] * vae_scale_factor
        if (h, w) not in resized:
            pixels = np.asarray(image.resize((w, h), Image.Resampling.LANCZOS), dtype=np.float32) / 127.5 - 1.0
            resized[(h, w)] = torch.from_numpy(pixels).permute(2, 0, 1)[None]
        for network in networks:
            network.set_cond_image(resized[(h, w)].to(sample.device, sample.dtype))

    handle = denoiser.register_forward_pre_hook(before, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        for network in networks:
            network.set_cond_image(None)


def generate_with_image_networks(family, components, networks: Sequence, requests: Sequence[GenerationRequest],
                                 **kwargs) -> list[GeneratedImage]:
    """generate_images, one group of requests per control image when some network takes one (in request order
    within each group, the groups in order of first appearance)."""
    takers = image_networks(networks)
    if not takers:
        return generate_images(family, components, requests, **kwargs)
    groups: dict[Optional[str], list[GenerationRequest]] = {}
    for r in requests:
        groups.setdefault(r.control_image, []).append(r)
    out: list[GeneratedImage] = []
    for path, group in groups.items():
        with control_image_set(takers, components.denoiser, path, family.vae_scale_factor):
            out += generate_images(family, components, group, **kwargs)
    return out
