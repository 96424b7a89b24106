"""Z-Image LoRA training step time against the bare diffusers step, measured in the same run.

The DiT of random:zimage (3840 wide, 30 heads of 128, the real refiners, embedders and pad tokens) at full width
with fewer main layers (--blocks), so it fits a CPU machine. Random weights, bf16 base (--dtype fp32 for CPUs
without fast bf16), batch 1, cached Qwen3 outputs (random second-to-last states of --tokens padded tokens, a quarter
of them real), transformer-only LoRA with musubi-tuner's default targets (the same network patched in for both
steps).

- reference: the noising by hand (x_t = (1 - σ)·x0 + σ·ε, σ uniform), ZImageTransformer2DModel forward as
  diffusers' ZImagePipeline calls it (a list of (C, 1, H, W) latents, t = 1 - σ, the caption's unpadded tokens), MSE
  of the negated output against ε - x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache) + clipping +
  optimizer and scheduler step, as Trainer runs them.

Prints s/step for both, their ratio (goal <= 1.05) and peak RSS.

    python bench/bench_zimage_step.py [--blocks 2] [--steps 4] [--tokens 512] [--resolution 64] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import (  # noqa: E402
    add_step_arguments,
    built,
    compare_lora_steps,
    frozen_in_dtype,
    llm_caption_text,
    lora_components,
    seeded_dtype_device,
)
from library.families import get_family  # noqa: E402
from library.families.zimage.configs import PRESETS, transformer_config  # noqa: E402
from library.families.zimage.options import ZImageFlowOptions, ZImageOptions  # noqa: E402


def build_transformer(blocks: int, dtype: torch.dtype):
    """random:zimage's DiT with `blocks` main layers, created directly in `dtype`."""
    from diffusers import ZImageTransformer2DModel

    p = dataclasses.replace(PRESETS["random:zimage"], layers=blocks)
    return frozen_in_dtype(lambda: ZImageTransformer2DModel(**transformer_config(p)), dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=2, help="main layers (Z-Image: 30)")
    p.add_argument("--tokens", type=int, default=512, help="Qwen3 tokens per caption, padded (default 512)")
    add_step_arguments(p, steps=4, resolution=64)
    a = p.parse_args()
    dtype, device = seeded_dtype_device(a)

    family = get_family("zimage")
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way)
    options = ZImageOptions(flow=ZImageFlowOptions(timestep_sampling="uniform", discrete_flow_shift=1.0))
    transformer = built(f"random:zimage's DiT with {a.blocks} main layers ({a.dtype})",
                        lambda: build_transformer(a.blocks, dtype).to(device))
    comps, lora = lora_components(family, transformer, options, a.dim, device)

    hidden = PRESETS["random:zimage"].qwen_hidden
    latent = a.resolution // 8
    latents = torch.randn(1, 16, latent, latent)
    text = llm_caption_text(a.tokens, hidden)
    caption_states = text["hidden_state"][text["attention_mask"].bool()].to(device, dtype)

    def loss(noisy, sigma, noise, x0):
        out = transformer([noisy[0].unsqueeze(1)], (1 - sigma).to(dtype), [caption_states], return_dict=False)[0]
        return F.mse_loss(-out[0].squeeze(1).float()[None], (noise - x0).float())

    compare_lora_steps(family, comps, lora, latents, text, loss, a, dtype, device,
                       f"{a.resolution}x{a.resolution} ({latent * latent // 4} image + {a.tokens // 4} text tokens), "
                       f"batch 1, {a.dtype}, {device}")


if __name__ == "__main__":
    main()
