"""SDXL LoRA training step time against the bare diffusers step, measured in the same run.

Full-size SDXL architecture (random:sdxl: 2.6B UNet, CLIP-L, OpenCLIP-bigG) with
random weights, which cost the same to run as trained ones; small images, batch 1,
UNet-only LoRA (the usual SDXL setting: both text encoders frozen).

The bare step as bench/bench_train_step.py (SD 1.5) defines it, and ours at default flags (issue 28):

- bare: tokenize with both tokenizers, both frozen encoders' penultimate states and the pooled projection
  (every step, as a naive loop and sd-scripts without --cache_text_encoder_outputs do), DDPM add_noise, UNet
  forward with text_time conditioning, MSE, backward, AdamW step on the same LoRA parameters, NCHW convolutions.
- ours: library.train.step.batch_loss (the trainer's micro-step) + clipping + optimizer and scheduler step,
  exactly as Trainer runs them, with the speed-ups the trainer turns on by default (library/train/speedups.py):
  the text-encoder outputs kept in memory once met (--no_auto_text_cache), the U-Net's frozen convolutions
  channels_last (--no_channels_last). Pass the same flags here to measure ours without one.

The two alternate step by step (the U-Net's layout switched between them, untimed); the minimum wall and CPU
seconds of each over --steps is compared, 1 thread by default. Base weights default to bf16 (held as the trainer
holds them under --mixed_precision bf16) so the model fits a shared CPU machine; pass --dtype fp32 for full
precision. Prints s/step for both, ours/bare (goal <= 0.90) and peak RSS.

    python bench/bench_sdxl_step.py [--steps 4] [--resolution 64] [--dtype bf16] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from bench.common import (  # noqa: E402
    compare_steps_min,
    lora_formula,
    lora_optimizer,
    peak_rss_mib,
    print_min_comparison,
    to_nchw,
    trainer_step,
)
from library.families import get_family
from library.families.base import Components
from library.families.sdxl.configs import build_sdxl_modules
from library.objectives.losses import LossOptions
from library.objectives.noise import NoiseOptions
from library.train.speedups import SpeedOptions, frozen_convs_channels_last
from library.train.step import StepContext
from networks import lora

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(dtype: torch.dtype, device: str) -> Components:
    """random:sdxl created directly in `dtype` (no float32 copy of 3.5B parameters in between)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        parts = build_sdxl_modules("random:sdxl", device=device)
    finally:
        torch.set_default_dtype(previous)
    for key in ("unet", "vae", "text_encoder", "text_encoder_2"):
        parts[key].requires_grad_(False)
    return Components(parts["unet"], parts["vae"], [parts["text_encoder"], parts["text_encoder_2"]],
                      [parts["tokenizer"], parts["tokenizer_2"]])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no_auto_text_cache", action="store_true")
    p.add_argument("--no_fused_lora", action="store_true")
    p.add_argument("--no_channels_last", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    speed = SpeedOptions(auto_text_cache=not a.no_auto_text_cache, channels_last=not a.no_channels_last,
                         fused_lora=not a.no_fused_lora)
    torch.manual_seed(0)
    dtype, device = DTYPES[a.dtype], torch.device(a.device)

    family = get_family("sdxl")
    t0 = time.perf_counter()
    comps = build(dtype, a.device)
    print(f"built random:sdxl ({a.dtype}) in {time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_mib():.0f} MiB; "
          f"{a.threads} thread(s); speed-ups: {speed}")
    unet, (te1, te2) = comps.denoiser, comps.text_encoders
    network = lora.create_network(1.0, a.dim, a.dim, None, [te1, te2], unet, lora_targets=family.lora_targets(comps))
    network.apply_to([te1, te2], unet, False, True)
    network.to(device)
    params, optimizer, scheduler = lora_optimizer(network)
    scheme = family.noise_scheme(comps)
    latent = a.resolution // 8
    latents = torch.randn(1, 4, latent, latent)
    caption = ["a photo of a sks dog sitting on a wooden chair, high quality"]
    sizes = torch.tensor([[a.resolution, a.resolution]])
    batch = {"latents": latents, "captions": caption, "loss_weights": torch.ones(1), "masks": None,
             "original_sizes_hw": sizes, "crop_top_lefts": torch.zeros(1, 2, dtype=torch.long),
             "target_sizes_hw": sizes}

    def reference_step() -> None:
        with torch.no_grad():
            ids = [tok(caption, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
                   for tok in comps.tokenizers]
            h1 = te1(ids[0].to(device), output_hidden_states=True).hidden_states[-2]
            out2 = te2(ids[1].to(device), output_hidden_states=True)
            hidden = torch.cat([h1, out2.hidden_states[-2]], dim=2)
        x0 = latents.to(device) * 0.13025
        noise = torch.randn_like(x0)
        t = torch.randint(0, 1000, (1,), device=device)
        noisy = scheme.add_noise(x0, noise, t).to(dtype)
        time_ids = torch.tensor([[a.resolution, a.resolution, 0, 0, a.resolution, a.resolution]], device=device, dtype=dtype)
        pred = unet(noisy, t, hidden, added_cond_kwargs={"text_embeds": out2.text_embeds, "time_ids": time_ids}).sample
        F.mse_loss(pred.float(), noise.float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    ctx = StepContext(family=family, components=comps, scheme=scheme, noise=NoiseOptions(), loss=LossOptions(),
                      device=device, weight_dtype=dtype, clip_skip=None, max_token_length=None,
                      train_text_encoder=False, autocast=contextlib.nullcontext)
    if speed.auto_text_cache:  # as library/train/text_caching.py start_auto_text_cache sets it
        ctx.text_cache, ctx.fill_text_cache = {}, True
    our_step = trainer_step(ctx, batch, params, optimizer, scheduler)

    bare_formula, ours_formula = lora_formula(network, False), lora_formula(network, speed.fused_lora)

    def bare_layout() -> None:
        to_nchw(unet)
        bare_formula()

    def ours_layout() -> None:
        if speed.channels_last:
            frozen_convs_channels_last(unet)
        ours_formula()

    result = compare_steps_min(reference_step, our_step, a.steps, a.warmup, bare_layout, ours_layout)
    print(f"LoRA modules: {len(network.unet_loras)} UNet; {a.resolution}x{a.resolution}, batch 1, {a.dtype}, {device}")
    print_min_comparison(result, 0.90)

if __name__ == "__main__":
    main()
