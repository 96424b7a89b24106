"""SD3.5 medium's position-embedding options (sd-scripts' --enable_scaled_pos_embed, --pos_emb_random_crop_rate).

The MMDiT adds a fixed 2D sin-cos embedding, cropped from the centre of a `pos_embed_max_size`²
grid. With scaled position embeddings (sd-scripts, contributed by KohakuBlueleaf) each training
resolution gets its own grid of 1.5x its patch count a side, whose coordinates are stretched so
that the image always spans the same range as the model's base 64x64-patch region (16 units);
an image of any bucket uses the grid of the training resolution nearest to its area (sd-scripts'
area thresholds: half-way between neighbours' areas, the largest up to 1.5² its area). With a
random crop rate, that share of training steps crops at a random place instead of the centre.

Installed by replacing the `cropped_pos_embed` method of the transformer's PatchEmbed instance
(diffusers calls it with the latent height and width); nothing else of the model changes.
"""

from __future__ import annotations

import math
import random
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

POS_EMBED_MAX_RATIO = 1.5
BASE_SIZE = 16


def scaled_sincos_grid(embed_dim: int, grid_size: int, sample_size: int, base_size: int = BASE_SIZE) -> torch.Tensor:
    """(grid_size², embed_dim) sin-cos embedding of a grid whose central `sample_size`² patches span `base_size` units."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed_from_grid

    coords = np.arange(grid_size, dtype=np.float32) / grid_size
    scale = base_size * grid_size / sample_size
    shift = scale * (grid_size - sample_size) / (2 * grid_size)
    coords = coords * scale - shift
    grid = np.stack(np.meshgrid(coords, coords), axis=0).reshape(2, 1, grid_size, grid_size)  # w first, as SD3
    return get_2d_sincos_pos_embed_from_grid(embed_dim, torch.from_numpy(grid), output_type="pt").float()


class ScaledPositions:
    """The scaled grids of a set of training resolutions and the crop rule; callable as PatchEmbed.cropped_pos_embed."""

    def __init__(self, patch_embed: nn.Module, latent_sizes: Optional[Sequence[int]], random_crop_rate: float):
        self.patch_embed = patch_embed
        self.patch = patch_embed.patch_size
        self.dim = patch_embed.pos_embed.shape[-1]
        self.random_crop_rate = random_crop_rate
        self.grids: dict[int, torch.Tensor] = {}
        self.areas: list[tuple[int, int]] = []  # (largest patch area, patched size), ascending
        if latent_sizes:
            sizes = sorted({s // self.patch for s in latent_sizes})
            limits = [(a * a + b * b) // 2 for a, b in zip(sizes, sizes[1:])]
            limits.append(int((sizes[-1] * POS_EMBED_MAX_RATIO) ** 2))
            self.areas = list(zip(limits, sizes))

    def _grid(self, size: int) -> torch.Tensor:
        if size not in self.grids:
            self.grids[size] = scaled_sincos_grid(self.dim, int(size * POS_EMBED_MAX_RATIO), size)
        return self.grids[size]

    def __call__(self, height: int, width: int) -> torch.Tensor:
        h, w = height // self.patch, width // self.patch
        random_crop = self.random_crop_rate > 0 and torch.is_grad_enabled() and random.random() < self.random_crop_rate
        if self.areas:
            size = next((s for limit, s in self.areas if h * w <= limit), self.areas[-1][1])
            side = int(size * POS_EMBED_MAX_RATIO)
            if h > side or w > side:  # taller or wider than the grid: a grid for this image, kept (as sd-scripts)
                size = max(h, w)
                side = int(size * POS_EMBED_MAX_RATIO)
                self.areas = sorted(self.areas + [(side * side, size)])
            grid = self._grid(size).reshape(side, side, self.dim)
        else:
            side = self.patch_embed.pos_embed_max_size
            grid = self.patch_embed.pos_embed.reshape(side, side, self.dim)
        if random_crop:
            top, left = random.randint(0, side - h), random.randint(0, side - w)
        else:
            top, left = (side - h) // 2, (side - w) // 2
        pos = self.patch_embed.pos_embed
        return grid[top:top + h, left:left + w].reshape(1, h * w, self.dim).to(pos.device, pos.dtype)


def install(transformer: nn.Module, latent_sizes: Optional[Sequence[int]], random_crop_rate: float) -> None:
    """Route the transformer's position embedding through ScaledPositions (latent_sizes None: the usual grid,
    only the random crop)."""
    patch_embed = transformer.pos_embed
    patch_embed.cropped_pos_embed = ScaledPositions(patch_embed, latent_sizes, random_crop_rate)


def latent_sizes_of(resolutions: Sequence[tuple[int, int]], vae_scale_factor: int = 8) -> list[int]:
    """sd-scripts' latent size per training resolution: round(√(w·h)) // 8."""
    return sorted({round(math.sqrt(w * h)) // vae_scale_factor for w, h in resolutions})
