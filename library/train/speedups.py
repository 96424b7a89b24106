"""Speed-ups that are on by default because they cannot change the result beyond float rounding; each has an
opt-out flag (library/cli/memory.py SpeedFlags) and a numerics test (tests/test_speedups.py). Gains: docs/performance.md.

- channels_last: the frozen Conv2d weights of the denoiser are stored NHWC, so the CPU (oneDNN) and GPU (cuDNN)
  convolution kernels run without reordering every activation. Decided by the model (it has Conv2d layers), not
  by the family.
- fused LoRA products: a LoRA'd Linear computes org(x) + up(down(x)) * scale as one autograd function
  (networks/lora_matmul.py): one product with the merged weight where the base is float32 and there are enough
  tokens, else the update added in the last product's epilogue; the rank-r gradients in the CPU's fast layout.
  Under autocast, in autocast's dtype as the plain formula runs there. Only where it is the plain formula (no
  dropout, float32 LoRA weights). Decided by each call.
- the automatic text-encoder output cache: when no text encoder trains and no caption can change between epochs,
  each caption is encoded once, the first time a step meets it, and its outputs are reused (library/train/step.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

logger = logging.getLogger(__name__)

_CONV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class SpeedOptions:
    auto_text_cache: bool = True  # --no_auto_text_cache turns it off
    channels_last: bool = True  # --no_channels_last turns it off
    fused_lora: bool = True  # --no_fused_lora turns it off


def frozen_convs_channels_last(model: torch.nn.Module) -> int:
    """Store the weights of `model`'s frozen 2-d convolutions (not training, a plain float dtype, 3x3 or larger)
    channels_last, in place; returns how many. Trained weights keep their layout, so optimizer states and saved
    files are unchanged; 1x1 kernels have one layout either way."""
    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Conv2d) and isinstance(weight, torch.Tensor) and not weight.requires_grad
                and weight.dtype in _CONV_DTYPES and weight.dim() == 4 and weight.shape[-2:] != (1, 1)
                and not weight.is_contiguous(memory_format=torch.channels_last)):
            module.weight.data = weight.data.contiguous(memory_format=torch.channels_last)
            n += 1
    return n


# On the CPU, channels_last pays only while the latent is small. bench/bench_train_step.py, SD 1.5 LoRA, fused
# products on, ours / bare with and without it: 128² (16x16 latent) 0.681 / 0.917; 256² (32x32) 0.896 / 0.874;
# 512² (64x64) 0.909 / 0.877. At small sizes oneDNN's NCHW kernels waste their vector width on a few pixels;
# at larger ones the NHWC <-> NCHW copies around diffusers' Transformer2DModel (which makes its output contiguous
# NCHW) cost more than the kernels gain.
CPU_CHANNELS_LAST_MAX_LATENT = 16 * 16


def channels_last_pays(device: torch.device, latent_sizes: Iterable[tuple[int, int]]) -> bool:
    """Whether channels_last speeds up a run on `device` whose largest latent is max(latent_sizes) (w, h): on a
    GPU always (cuDNN's NHWC kernels), on the CPU up to CPU_CHANNELS_LAST_MAX_LATENT positions."""
    if torch.device(device).type != "cpu":
        return True
    return max((w * h for w, h in latent_sizes), default=0) <= CPU_CHANNELS_LAST_MAX_LATENT


def use_channels_last(model: Optional[torch.nn.Module], options: SpeedOptions, device: torch.device = None,
                      latent_sizes: Iterable[tuple[int, int]] = ()) -> int:
    """frozen_convs_channels_last for a model with Conv2d layers when the option is on and it pays
    (channels_last_pays); one log line."""
    if model is None or not options.channels_last:
        return 0
    latent_sizes = list(latent_sizes)
    if device is not None and not channels_last_pays(device, latent_sizes):
        if any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
            w, h = max(latent_sizes, key=lambda s: s[0] * s[1])
            logger.info("channels_last: off on the CPU for %dx%d latents (it pays there up to %d positions; "
                        "docs/performance.md)", w, h, CPU_CHANNELS_LAST_MAX_LATENT)
        return 0
    n = frozen_convs_channels_last(model)
    if n:
        logger.info("channels_last: %d frozen convolutions of the denoiser stored NHWC for faster kernels "
                    "(--no_channels_last to keep NCHW)", n)
    return n


def use_fused_lora(network: Optional[torch.nn.Module], options: SpeedOptions) -> int:
    """Let the LoRA modules of `network` compute fused (networks/lora_matmul.py) when the option is on; returns
    how many modules may (each call still checks that it is the plain formula). One log line."""
    if network is None or not options.fused_lora:
        return 0
    modules = [m for m in network.modules() if hasattr(m, "fused_matmul")]
    for module in modules:
        module.fused_matmul = True
    if modules:
        logger.info("fused LoRA products: %d LoRA modules compute their update with the frozen layer's product "
                    "(--no_fused_lora for the plain formula)", len(modules))
    return len(modules)


def auto_text_cache_blocked(options: SpeedOptions, explicit_cache: bool, text_encoders_train: bool,
                            caption_randomness: Iterable[Optional[str]], num_text_encoders: int) -> Optional[str]:
    """Why the automatic text-encoder cache is off for this run, or None when it is on."""
    if not options.auto_text_cache:
        return "--no_auto_text_cache"
    if explicit_cache:
        return "--cache_text_encoder_outputs"
    if num_text_encoders == 0:
        return "no text encoder"
    if text_encoders_train:
        return "a text encoder trains"
    random_part = next((r for r in caption_randomness if r), None)
    if random_part:
        return f"{random_part} changes captions between steps"
    return None
