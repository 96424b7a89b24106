"""The 16-channel autoencoder of FLUX.1 (also Lumina's): its config, latent normalisation and BFL's ae.safetensors."""

from __future__ import annotations

from typing import Mapping

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
    from diffusers import AutoencoderKL


    label = "--ae"
    ckpt = read_file(label, path, AE_FILE,
                      lambda keys: "encoder.conv_in.weight" in keys and "decoder.conv_in.weight" in keys, dtype)
    try:
        found = infer_vae_config(ckpt, "")
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: autoencoder tensors are incomplete ({e})") from None
    if found["latent_channels"] != LATENT_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected the FLUX.1 autoencoder with {LATENT_CHANNELS} latent "
                             f"channels, found {found['latent_channels']} (an SD/SDXL VAE?)")
    config = {**flux_vae_config(found["block_out_channels"]), "layers_per_block": found["layers_per_block"]}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoencoderKL(**config).state_dict().items()}
    try:
        state_dict = ldm.pull(ckpt, ldm.vae_key_map(shapes, ""), shapes)
    except (ldm.LayoutError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: autoencoder tensors are incomplete or mis-shaped ({e})") from None
    return adopt(label, path, lambda: AutoencoderKL(**config), state_dict)


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
