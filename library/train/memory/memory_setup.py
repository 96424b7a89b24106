"""Putting the frozen base model in place under the memory options: float8 weights, swapped blocks, checkpointing."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from library.core.errors import warn_once
from library.families.base import Components, ModelFamily
from library.train.memory.block_swap import BlockSwapper
from library.train.memory.fp8 import cast_base_to_fp8
from library.train.memory.offload_checkpoint import enable_gradient_checkpointing

POLICY_KEEPS = {"attention": "attention", "matmul": "attention, matrix products and convolutions"}
from library.train.memory.quantize import NO_CHANGE, quantize_frozen

logger = logging.getLogger(__name__)


@dataclass
class MemoryOptions:
    """How the frozen base model is stored and placed during training."""
    fp8_base: bool = False  # Linear/Conv2d weights of the denoiser (and text encoders) stored as float8 e4m3
    fp8_base_unet: bool = False  # float8 for the denoiser only; the text encoders keep the training dtype
    blocks_to_swap: Optional[int] = None  # the family's rule turns N into the blocks kept in CPU memory
    cpu_offload_checkpointing: bool = False  # checkpointed block inputs wait in CPU memory for the backward pass
    gradient_checkpointing_policy: str = "full"  # what a checkpointed block keeps (memory/checkpoint_policy.py)
    xformers: bool = False  # --xformers: xformers attention when the package is installed, else PyTorch SDPA
    flash_attn: bool = False  # --flash_attn: diffusers' "flash" attention backend when flash-attn is installed
    base_model_precision: str = "no_change"  # the frozen denoiser's Linear weights, quantized (memory/quantize.py)
    text_encoder_precision: str = "no_change"  # the same for the frozen text encoders

    @property
    def fp8_text_encoders(self) -> bool:
        return self.fp8_base and not self.fp8_base_unet


def move_except(model: nn.Module, device: Any, keep: list[nn.Module]) -> None:
    """Move `model`'s parameters and buffers to `device`, except those of the modules in `keep`."""
    kept = {id(t) for m in keep for t in list(m.parameters()) + list(m.buffers())}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in kept:
            t.data = t.data.to(device)


def apply_memory_options(family: ModelFamily, components: Components, opts: Optional[MemoryOptions],
                         device: Any, gradient_checkpointing: bool = False,
                         steps_in_backward: bool = False) -> Optional[BlockSwapper]:
    """Cast, place and hook the denoiser and text encoders (already in the training dtype, on any device).

    float8 comes first (anything merged into the base is merged before), then the swapped
    blocks go to CPU memory and everything else to `device`. Returns the swapper, if any.
    `steps_in_backward`: the model's own weights are stepped inside backward (a fused full fine-tune), so
    swapped blocks are copied back to CPU memory after their backward.
    """
    opts = opts or MemoryOptions()
    c = components
    if opts.fp8_base:
        parts = [c.denoiser, *(c.text_encoders if opts.fp8_text_encoders else [])]
        count = sum(cast_base_to_fp8(m) for m in parts)
        logger.info("--fp8_base: %d layers store float8 weights", count)
    for value, parts, flag in ((opts.base_model_precision, [c.denoiser], "base_model_precision"),
                               (opts.text_encoder_precision, c.text_encoders, "text_encoder_precision")):
        if value != NO_CHANGE:
            count = sum(quantize_frozen(m, value) for m in parts)
            logger.info("--%s %s: %d Linear layers store quantized weights", flag, value, count)
    swapper = None
    if opts.blocks_to_swap:
        blocks = family.swappable_blocks(c, opts.blocks_to_swap)
        offload = torch.device("cpu")
        swapper = BlockSwapper(blocks, len(blocks), device, offload, write_back=steps_in_backward)
        logger.info("--blocks_to_swap %d: %d blocks stay in CPU memory and are streamed to %s", opts.blocks_to_swap,
                    len(blocks), device)
        if torch.device(device) == offload:
            logger.warning("--blocks_to_swap: training on the CPU, so swapping only costs time")
    if opts.xformers:
        apply_xformers(c)
    if opts.flash_attn:
        apply_flash_attention(c)
    move_except(c.denoiser, device, swapper.swapped if swapper else [])
    for te in c.text_encoders:
        te.to(device)
    if gradient_checkpointing:
        enable_gradient_checkpointing(c.denoiser, opts.cpu_offload_checkpointing, opts.gradient_checkpointing_policy)
        if opts.gradient_checkpointing_policy != "full":
            logger.info("--gradient_checkpointing_policy %s: checkpointed blocks keep the outputs of %s",
                        opts.gradient_checkpointing_policy, POLICY_KEEPS[opts.gradient_checkpointing_policy])
    elif swapper is not None:
        logger.warning("--blocks_to_swap without --gradient_checkpointing: autograd keeps the device copies of "
                       "weights it saved for backward, so little memory is saved; add --gradient_checkpointing")
    return swapper


XFORMERS_MISSING = ("--xformers: the xformers package is not installed, so PyTorch SDPA attention is used "
                    "(as fast on recent PyTorch); pip install xformers to use it")


def xformers_installed() -> bool:
    return importlib.util.find_spec("xformers") is not None


def apply_xformers(components: Components) -> list[str]:
    """--xformers: xformers attention in the denoiser and the VAE through diffusers, as sd-scripts does.

    Without the package (or where a model's attention cannot use it) a warning is logged once and the
    model keeps PyTorch SDPA. Returns the parts that use xformers.
    """
    if not xformers_installed():
        warn_once(logger, XFORMERS_MISSING)
        return []
    used = []
    for name, model in (("denoiser", components.denoiser), ("VAE", components.vae)):
        enable = getattr(model, "enable_xformers_memory_efficient_attention", None)
        if enable is None:
            warn_once(logger, f"--xformers: the {name} ({type(model).__name__}) has no xformers attention; "
                              "it uses PyTorch SDPA")
            continue
        try:
            enable()
        except Exception as e:  # no CUDA build, an attention processor without an xformers variant, ...
            warn_once(logger, f"--xformers: cannot use xformers in the {name} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              "it uses PyTorch SDPA")
            continue
        used.append(name)
    if used:
        logger.info("--xformers: xformers attention in the %s", " and ".join(used))
    return used


def park_cached_parts(components: Components, device: Any, latents_cached: bool,
                      cached_text_encoders: Iterable[int] = ()) -> list[str]:
    """Move the parts whose outputs are all cached (the VAE, the numbered frozen text encoders) to CPU memory.

    The step never runs them then; sampling borrows them back for its prompts and decoding.
    Returns what was moved, for the log (nothing when training on the CPU).
    """
    if torch.device(device).type == "cpu":
        return []
    parked = []
    if latents_cached:
        components.vae.to("cpu")
        parked.append("VAE")
    for i in sorted(cached_text_encoders):
        components.text_encoders[i].to("cpu")
        parked.append(f"text encoder {i + 1}")
    if parked:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("outputs cached: %s wait in CPU memory (sampling borrows them)", ", ".join(parked))
    return parked


FLASH_MISSING = ("--flash_attn: the flash-attn package is not installed (pip install flash-attn; CUDA only), so "
                 "PyTorch SDPA attention is used")


def apply_flash_attention(components: Components) -> bool:
    """--flash_attn: diffusers' "flash" attention backend in the denoiser. Without the package, or where the
    model or the device cannot use it, one warning and PyTorch SDPA. Returns whether FlashAttention is on."""
    if importlib.util.find_spec("flash_attn") is None:
        warn_once(logger, FLASH_MISSING)
        return False
    model = components.denoiser
    set_backend = getattr(model, "set_attention_backend", None)
    if set_backend is None:
        warn_once(logger, f"--flash_attn: the denoiser ({type(model).__name__}) has no attention backends; "
                          "it uses PyTorch SDPA")
        return False
    try:
        set_backend("flash")
    except Exception as e:  # a CPU run, a build without the kernels, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        warn_once(logger, f"--flash_attn: cannot use FlashAttention ({reason}); PyTorch SDPA is used")
        return False
    logger.info("--flash_attn: FlashAttention in the denoiser")
    return True
