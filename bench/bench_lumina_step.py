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
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import (  # noqa: E402
    cached_text_step,
    compare_steps,
    denoiser_lora,
    peak_rss_mib,
    print_comparison,
)
from library.families import get_family  # noqa: E402
from library.families.base import Components  # noqa: E402
from library.families.lumina.configs import PRESETS, transformer_config  # noqa: E402
from library.families.lumina.options import LuminaFlowOptions, LuminaOptions  # noqa: E402
from library.families.common.tiny import build_seeded  # noqa: E402


def build_transformer(blocks: int, dtype: torch.dtype):
    """random:lumina2's NextDiT with `blocks` main layers, created directly in `dtype`."""
    from diffusers import Lumina2Transformer2DModel

    p = dataclasses.replace(PRESETS["random:lumina2"], layers=blocks)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_seeded(lambda: Lumina2Transformer2DModel(**transformer_config(p)), 0)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=2, help="main layers (Lumina Image 2.0: 26)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256, help="Gemma-2 tokens per caption (sd-scripts' default 256)")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    a = p.parse_args()
    torch.manual_seed(0)
    dtype, device = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype], torch.device(a.device)

    family = get_family("lumina")
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way)
    options = LuminaOptions(flow=LuminaFlowOptions(timestep_sampling="uniform", discrete_flow_shift=1.0))
    t0 = time.perf_counter()
    transformer = build_transformer(a.blocks, dtype).to(device)
    print(f"built random:lumina2's NextDiT with {a.blocks} main layers ({a.dtype}) in {time.perf_counter() - t0:.1f}s, "
          f"peak RSS {peak_rss_mib():.0f} MiB")
    comps = Components(transformer, vae=None, text_encoders=[], tokenizers=[], options=options)
    network, params, optimizer, scheduler = denoiser_lora(family, comps, transformer, a.dim, device)

    hidden = PRESETS["random:lumina2"].gemma_hidden
    latent = a.resolution // 8
    latents = torch.randn(1, 16, latent, latent)
    caption = "a photo of a sks dog sitting on a wooden chair, high quality"
    mask = torch.zeros(a.tokens, dtype=torch.long)
    mask[: a.tokens // 4] = 1  # a caption of a quarter of the padded length, as most are
    text = {"hidden_state": torch.randn(a.tokens, hidden), "input_ids": torch.zeros(a.tokens, dtype=torch.long),
            "attention_mask": mask}
    batch = {"latents": latents, "captions": [caption], "loss_weights": torch.ones(1), "masks": None}
    states = text["hidden_state"][None].to(device, dtype)
    caption_mask = mask[None].to(device).bool()

    def reference_step() -> None:
        x0 = latents.to(device)
        noise = torch.randn_like(x0)
        t = 1 - torch.rand(1, device=device)  # t = 1 - σ: 1 is the clean image
        noisy = (t * x0 + (1 - t) * noise).to(dtype)
        out = transformer(hidden_states=noisy, timestep=t.to(dtype), encoder_hidden_states=states,
                          encoder_attention_mask=caption_mask, return_dict=False)[0]
        F.mse_loss(out.float(), (x0 - noise).float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    our_step = cached_text_step(family, comps, device, dtype, {caption: text}, batch, params, optimizer,
                                scheduler)

    result = compare_steps(reference_step, our_step, a.steps, a.warmup)
    print(f"LoRA modules: {len(network.unet_loras)} transformer; {a.resolution}x{a.resolution} "
          f"({latent * latent // 4} image + {a.tokens} text tokens), batch 1, {a.dtype}, {device}")
    print_comparison(result)


if __name__ == "__main__":
    main()
