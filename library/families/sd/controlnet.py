"""ControlNet for the UNet families (SD 1.x/2.x here, SDXL through the same functions): diffusers' ControlNetModel,
initialised from the UNet (`ControlNetModel.from_unet`, as sd-scripts' train_control_net.py), its residuals added
in the UNet's forward (`down_block_additional_residuals`, `mid_block_additional_residual`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from library.families.common.controlnet import load_controlnet_weights
from library.families.common.diffusers_import import diffusers_class


def create_unet_controlnet(unet: nn.Module, path: Optional[str]) -> nn.Module:
    """A ControlNet copied from `unet` (its encoder half; zero-initialised output convolutions), float32; with
    `path` the saved ControlNet there (a diffusers folder, or one of our single files) instead."""
    ControlNetModel = diffusers_class("ControlNetModel")

    def fresh():
        return ControlNetModel.from_unet(unet).to(torch.float32)

    return load_controlnet_weights(ControlNetModel, path, fresh) if path else fresh()


def unet_control_kwargs(controlnet: Optional[nn.Module], noisy: torch.Tensor, timesteps: torch.Tensor,
                        hidden: torch.Tensor, batch: dict, added_cond_kwargs: Optional[dict] = None) -> dict:
    """The UNet forward's extra keyword arguments: the ControlNet's residuals for batch["conditioning_images"]
    ((B, 3, H, W) in 0..1, the pixel size of the latents), scaled by batch["controlnet_scale"] (default 1); {} when
    there is no ControlNet or no conditioning image."""
    cond = batch.get("conditioning_images")
    if controlnet is None or cond is None:
        return {}
    extra = {"added_cond_kwargs": added_cond_kwargs} if added_cond_kwargs is not None else {}
    down, mid = controlnet(noisy, timesteps, encoder_hidden_states=hidden,
                           controlnet_cond=cond.to(noisy.device, noisy.dtype),
                           conditioning_scale=float(batch.get("controlnet_scale", 1.0)), return_dict=False, **extra)
    return {"down_block_additional_residuals": [d.to(noisy.dtype) for d in down],
            "mid_block_additional_residual": mid.to(noisy.dtype)}
