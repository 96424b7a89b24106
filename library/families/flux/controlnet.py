"""FLUX.1 ControlNet: diffusers' FluxControlNetModel (the InstantX layout ComfyUI loads), its first double and single
blocks copied from the transformer (`FluxControlNetModel.from_transformer`; --num_double_blocks /
--num_single_blocks); the conditioning image is VAE-encoded and packed as the latents are, and the residuals go
into the transformer's `controlnet_block_samples` / `controlnet_single_block_samples`.

sd-scripts' flux_train_control_net.py trains its own ControlNetFlux (XLabs-style, a convolution stack on the
pixels) instead; docs/differences.md says so.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from library.core.errors import UserError
from library.families.common.controlnet import load_controlnet_weights
from library.families.common.diffusers_import import diffusers_class

DEFAULT_DOUBLE_BLOCKS = 2
DEFAULT_SINGLE_BLOCKS = 0


def create_flux_controlnet(transformer: nn.Module, path: Optional[str], num_double_blocks: Optional[int],
                           num_single_blocks: Optional[int]) -> nn.Module:
    FluxControlNetModel = diffusers_class("FluxControlNetModel")

    cfg = transformer.config
    double = DEFAULT_DOUBLE_BLOCKS if num_double_blocks is None else num_double_blocks
    single = DEFAULT_SINGLE_BLOCKS if num_single_blocks is None else num_single_blocks
    for flag, value, most in (("--num_double_blocks", double, cfg.num_layers),
                              ("--num_single_blocks", single, cfg.num_single_layers)):
        if not 0 <= value <= most:
            raise UserError(f"{flag} {value}: expected 0 to {most} (the blocks of the transformer)")
    if double + single == 0:
        raise UserError("--num_double_blocks 0 --num_single_blocks 0: the ControlNet needs at least one block")
    def fresh():
        return FluxControlNetModel.from_transformer(transformer, num_layers=double, num_single_layers=single,
                                                    attention_head_dim=cfg.attention_head_dim,
                                                    num_attention_heads=cfg.num_attention_heads).to(torch.float32)

    return load_controlnet_weights(FluxControlNetModel, path, fresh) if path else fresh()


def flux_control_kwargs(family, components, noisy: torch.Tensor, model_kwargs: dict, batch: dict,
                        pack_latents: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The transformer's extra keyword arguments for batch["conditioning_images"] ((B, 3, H, W) in 0..1): the
    ControlNet's block samples; {} without a ControlNet or conditioning image. `model_kwargs`: the transformer's
    own inputs (the ControlNet takes the same); `pack_latents`: the family's (B, C, H, W) -> tokens."""
    controlnet, cond = components.controlnet, batch.get("conditioning_images")
    if controlnet is None or cond is None:
        return {}
    vae = components.vae
    # The conditioning image's latents as the target's are made (library/train/step.py batch_latents), each
    # posterior sample from a fixed seed: the same latents every step, on any device and after a resume.
    generators = [torch.Generator().manual_seed(0) for _ in range(cond.shape[0])]
    with torch.no_grad():
        latents = family.encode_images(vae, (cond * 2 - 1).to(vae.device, vae.dtype), generators)
        latents = family.scale_latents(latents.to(noisy.device, torch.float32)).to(noisy.dtype)
    blocks, single = controlnet(controlnet_cond=pack_latents(latents),
                                conditioning_scale=float(batch.get("controlnet_scale", 1.0)), return_dict=False,
                                **model_kwargs)
    return {"controlnet_block_samples": blocks, "controlnet_single_block_samples": single}
