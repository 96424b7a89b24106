"""The 16-channel autoencoder of FLUX.1 (also Lumina's): its config, latent normalisation and BFL's ae.safetensors."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from library.families.base import ModelLoadError
from library.families.common import ldm_layout as ldm
from library.families.common.configs import (
    NORM_GROUPS,
)
from library.families.common.loading import (
    adopt,
    infer_vae_config,
    read_file,
)
from library.families.common.diffusers_import import diffusers_class

# What an --ae file should hold (for its error message).
AE_FILE = "the FLUX.1 autoencoder (ae.safetensors)"
# The FLUX.1 autoencoder's own latent normalisation (diffusers' vae config of black-forest-labs/FLUX.1-dev).
AE_SCALING_FACTOR = 0.3611
AE_SHIFT_FACTOR = 0.1159


def flux_vae_config(block_out_channels: tuple[int, ...]) -> dict:
    """AutoencoderKL kwargs of the FLUX.1 AE: 16 latent channels, no quant convs, its scale and shift."""
    n = len(block_out_channels)
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_out_channels),
                layers_per_block=2, latent_channels=LATENT_CHANNELS, norm_num_groups=NORM_GROUPS,
                use_quant_conv=False, use_post_quant_conv=False, scaling_factor=AE_SCALING_FACTOR,
                shift_factor=AE_SHIFT_FACTOR)


def load_ae_file(path: str, dtype: torch.dtype = torch.float32):
    """AutoencoderKL from BFL's ae.safetensors (LDM VAE keys without prefix, 16 latent channels)."""
    AutoencoderKL = diffusers_class("AutoencoderKL")

    return load_ldm_ae_file(path, dtype, AutoencoderKL, flux_vae_config, latent_channels=LATENT_CHANNELS,
                            expected=AE_FILE, holds=lambda keys: "encoder.conv_in.weight" in keys
                            and "decoder.conv_in.weight" in keys, what="FLUX.1", mismatch_hint=" (an SD/SDXL VAE?)")


def load_ldm_ae_file(path: str, dtype: torch.dtype, cls, config_for: Callable[[tuple[int, ...]], dict], *,
                     latent_channels: int, expected: str, holds: Callable[[list[str]], bool], what: str,
                     mismatch_hint: str = "", as_stored: Optional[Mapping[str, Optional[torch.Tensor]]] = None):
    """`cls` (a diffusers autoencoder, `config_for(block_out_channels)` its kwargs) from an --ae file in BFL's LDM
    names without prefix, its sizes read from the shapes. `as_stored`: keys of the model the file holds under the
    same name, each with the tensor to use where the file lacks it (None: required). One-line ModelLoadErrors: a
    file `holds` rejects ("expected `expected`"), another latent width than `latent_channels` (the `what`
    autoencoder), missing or mis-shaped tensors."""
    label = "--ae"
    as_stored = as_stored or {}
    ckpt = read_file(label, path, expected, holds, dtype)
    try:
        found = infer_vae_config(ckpt, "")
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: autoencoder tensors are incomplete ({e})") from None
    if found["latent_channels"] != latent_channels:
        raise ModelLoadError(f"{label} {path}: expected the {what} autoencoder with {latent_channels} latent "
                             f"channels, found {found['latent_channels']}{mismatch_hint}")
    config = {**config_for(found["block_out_channels"]), "layers_per_block": found["layers_per_block"]}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in cls(**config).state_dict().items() if k not in as_stored}
    try:
        state_dict = ldm.pull(ckpt, ldm.vae_key_map(shapes, ""), shapes)
    except (ldm.LayoutError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: autoencoder tensors are incomplete or mis-shaped ({e})") from None
    for key, default in as_stored.items():
        value = ckpt.get(key, default)
        if value is not None:
            state_dict[key] = value
    return adopt(label, path, lambda: cls(**config), state_dict)


LATENT_CHANNELS = 16


def ae_file_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers autoencoder's state dict in the LDM names of BFL's AE files (no prefix: `encoder.down.0...`)."""
    return ldm.push(state, ldm.vae_key_map(state.keys(), ""))


def ae_scale_and_shift(vae) -> tuple[float, float]:
    """(scaling_factor, shift_factor) of a FLUX.1-style 16-channel autoencoder, from its config, else FLUX.1's."""
    config = getattr(vae, "config", None)
    scale = getattr(config, "scaling_factor", None) or AE_SCALING_FACTOR
    shift = getattr(config, "shift_factor", None)
    return scale, AE_SHIFT_FACTOR if shift is None else shift


def normalize_ae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Raw autoencoder latents -> the model's latent space: (x - shift) · scale."""
    scale, shift = ae_scale_and_shift(vae)
    return (latents - shift) * scale


def denormalize_ae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of normalize_ae_latents, before decoding."""
    scale, shift = ae_scale_and_shift(vae)
    return latents / scale + shift
