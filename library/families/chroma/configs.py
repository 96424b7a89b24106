"""Chroma's built-in presets (tiny:chroma, random:chroma): the transformer sizes, with no model code, so that
cheap lookups (library/families/detect.py) can name them without importing the loaders."""

from __future__ import annotations

from dataclasses import dataclass

PRESET_SEED = 20250615


@dataclass(frozen=True)
class ChromaPreset:
    """A built-in Chroma model: the transformer's sizes, and the FLUX.1 preset its T5 and AE come from."""

    name: str
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    axes_dims_rope: tuple[int, int, int]
    approximator_hidden: int
    approximator_layers: int
    flux_preset: str  # T5-XXL and AE sizes


PRESETS: dict[str, ChromaPreset] = {
    "tiny:chroma": ChromaPreset("tiny:chroma", 2, 3, 2, 16, (4, 6, 6), 32, 2, "tiny:flux"),
    # lodestones/Chroma1-HD's transformer config (also sd-scripts' chroma_params)
    "random:chroma": ChromaPreset("random:chroma", 19, 38, 24, 128, (16, 56, 56), 5120, 5, "random:flux-dev"),
}
APPROXIMATOR_CHANNELS = 64  # the approximator's input: 16 timestep + 16 guidance + 32 modulation-index channels
