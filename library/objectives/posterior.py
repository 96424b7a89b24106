"""The VAE posterior sample of each image, drawn from that image's own seed.

A VAE encodes an image into a diagonal Gaussian (mean, std); training uses one sample of it. Drawn from
whatever generator the encoding process holds, that sample would depend on which process encoded the image,
in which batch and in which order, so the training data itself would change with the number of processes.
Here each image's draw comes from a seed of the image itself: a hash of the exact pixels handed to the VAE
(after crop and flip, so each variant of an image has its own). The same pixels get the same latent whoever
encodes them, cached or not, in whatever batch. The draw runs on the CPU (as the training noise does), so it
does not depend on the device either.

The seed does not include `--seed`: a cached latent is then a function of the image, the VAE and the cache
settings only, so a cache stays valid (and exact) across runs with other seeds, and a run without `--seed`
(which draws a new one) still reuses it.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

# Recorded in latent cache settings: caches whose latents were drawn otherwise are rebuilt.
POSTERIOR_DRAW = "per-image seed (sha256 of the pixels)"


def image_seed(image: torch.Tensor) -> int:
    """The posterior seed of one image (C, H, W): a 63-bit hash of its float32 pixel values and shape."""
    pixels = image.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(f"posterior/{tuple(pixels.shape)}/".encode())
    digest.update(pixels.numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def posterior_generators(images: torch.Tensor) -> list[torch.Generator]:
    """One CPU generator per image of a batch (B, C, H, W), seeded by `image_seed`."""
    return [torch.Generator("cpu").manual_seed(image_seed(image)) for image in images]


def posterior_sample(dist, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """`mean + std * eps` of a diagonal Gaussian posterior (diffusers' `latent_dist`), float32, with image i's
    eps drawn from `generators[i]`."""
    mean, std = dist.mean.float(), dist.std.float()
    if len(generators) != mean.shape[0]:
        raise ValueError(f"posterior_sample: {len(generators)} generators for a batch of {mean.shape[0]}")
    eps = torch.stack([torch.randn(tuple(mean.shape[1:]), generator=g, dtype=torch.float32) for g in generators])
    return mean + std * eps.to(mean.device)
