"""Lumina Image 2.0 LoRA training step time against the bare diffusers step, measured in the same run.

The NextDiT of random:lumina2 (hidden 2304, 24 heads / 8 KV heads, the real refiners and embedders) at full width
with fewer main layers (--blocks), so it fits a CPU machine. Random weights, bf16 base (--dtype fp32 for CPUs
without fast bf16), batch 1, cached Gemma-2
outputs (random second-to-last states of --tokens tokens), transformer-only kohya LoRA (the same network patched
in for both steps).

- reference: Lumina's noising by hand (x_t = t·x0 + (1 - t)·ε, t = 1 - σ, σ uniform), Lumina2Transformer2DModel
  forward with the caption mask, MSE of its output against x0 - ε, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache) + clipping +
  optimizer and scheduler step, as Trainer runs them.

Prints s/step for both, their ratio (goal <= 1.05) and peak RSS.

    python bench/bench_lumina_step.py [--blocks 2] [--steps 4] [--tokens 256] [--resolution 64] [--dtype fp32]
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
from library.families.lumina.configs import PRESETS, transformer_config  # noqa: E402
from library.families.lumina.options import LuminaFlowOptions, LuminaOptions  # noqa: E402


def build_transformer(blocks: int, dtype: torch.dtype):
    """random:lumina2's NextDiT with `blocks` main layers, created directly in `dtype`."""
    from diffusers import Lumina2Transformer2DModel

    p = dataclasses.replace(PRESETS["random:lumina2"], layers=blocks)
    return frozen_in_dtype(lambda: Lumina2Transformer2DModel(**transformer_config(p)), dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=2, help="main layers (Lumina Image 2.0: 26)")
    p.add_argument("--tokens", type=int, default=256, help="Gemma-2 tokens per caption (sd-scripts' default 256)")
    add_step_arguments(p, steps=4, resolution=64)
    a = p.parse_args()
    dtype, device = seeded_dtype_device(a)

    family = get_family("lumina")
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way)
    options = LuminaOptions(flow=LuminaFlowOptions(timestep_sampling="uniform", discrete_flow_shift=1.0))
    transformer = built(f"random:lumina2's NextDiT with {a.blocks} main layers ({a.dtype})",
                        lambda: build_transformer(a.blocks, dtype).to(device))
    comps, lora = lora_components(family, transformer, options, a.dim, device)

    hidden = PRESETS["random:lumina2"].gemma_hidden
    latent = a.resolution // 8
    latents = torch.randn(1, 16, latent, latent)
    text = llm_caption_text(a.tokens, hidden)
    states = text["hidden_state"][None].to(device, dtype)
    caption_mask = text["attention_mask"][None].to(device).bool()

    def loss(noisy, sigma, noise, x0):  # Lumina's t = 1 - σ: 1 is the clean image
        out = transformer(hidden_states=noisy, timestep=(1 - sigma).to(dtype), encoder_hidden_states=states,
                          encoder_attention_mask=caption_mask, return_dict=False)[0]
        return F.mse_loss(out.float(), (x0 - noise).float())

    compare_lora_steps(family, comps, lora, latents, text, loss, a, dtype, device,
                       f"{a.resolution}x{a.resolution} ({latent * latent // 4} image + {a.tokens} text tokens), "
                       f"batch 1, {a.dtype}, {device}")


if __name__ == "__main__":
    main()
