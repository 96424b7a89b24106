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
from library.families.common.tiny import build_seeded  # noqa: E402
from library.families.zimage.configs import PRESETS, transformer_config  # noqa: E402
from library.families.zimage.options import ZImageFlowOptions, ZImageOptions  # noqa: E402


def build_transformer(blocks: int, dtype: torch.dtype):
    """random:zimage's DiT with `blocks` main layers, created directly in `dtype`."""
    from diffusers import ZImageTransformer2DModel

    p = dataclasses.replace(PRESETS["random:zimage"], layers=blocks)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_seeded(lambda: ZImageTransformer2DModel(**transformer_config(p)), 0)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=2, help="main layers (Z-Image: 30)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tokens", type=int, default=512, help="Qwen3 tokens per caption, padded (default 512)")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    a = p.parse_args()
    torch.manual_seed(0)
    dtype, device = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype], torch.device(a.device)

    family = get_family("zimage")
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way)
    options = ZImageOptions(flow=ZImageFlowOptions(timestep_sampling="uniform", discrete_flow_shift=1.0))
    t0 = time.perf_counter()
    transformer = build_transformer(a.blocks, dtype).to(device)
    print(f"built random:zimage's DiT with {a.blocks} main layers ({a.dtype}) in {time.perf_counter() - t0:.1f}s, "
          f"peak RSS {peak_rss_mib():.0f} MiB")
    comps = Components(transformer, vae=None, text_encoders=[], tokenizers=[], options=options)
    network, params, optimizer, scheduler = denoiser_lora(family, comps, transformer, a.dim, device)

    hidden = PRESETS["random:zimage"].qwen_hidden
    latent = a.resolution // 8
    latents = torch.randn(1, 16, latent, latent)
    caption = "a photo of a sks dog sitting on a wooden chair, high quality"
    mask = torch.zeros(a.tokens, dtype=torch.long)
    mask[: a.tokens // 4] = 1  # a caption of a quarter of the padded length
    text = {"hidden_state": torch.randn(a.tokens, hidden), "input_ids": torch.zeros(a.tokens, dtype=torch.long),
            "attention_mask": mask}
    batch = {"latents": latents, "captions": [caption], "loss_weights": torch.ones(1), "masks": None}
    caption_states = text["hidden_state"][mask.bool()].to(device, dtype)

    def reference_step() -> None:
        x0 = latents.to(device)
        noise = torch.randn_like(x0)
        sigma = torch.rand(1, device=device)
        noisy = ((1 - sigma) * x0 + sigma * noise).to(dtype)
        out = transformer([noisy[0].unsqueeze(1)], (1 - sigma).to(dtype), [caption_states], return_dict=False)[0]
        F.mse_loss(-out[0].squeeze(1).float()[None], (noise - x0).float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    our_step = cached_text_step(family, comps, device, dtype, {caption: text}, batch, params, optimizer,
                                scheduler)

    result = compare_steps(reference_step, our_step, a.steps, a.warmup)
    print(f"LoRA modules: {len(network.unet_loras)} transformer; {a.resolution}x{a.resolution} "
          f"({latent * latent // 4} image + {a.tokens // 4} text tokens), batch 1, {a.dtype}, {device}")
    print_comparison(result)


if __name__ == "__main__":
    main()
