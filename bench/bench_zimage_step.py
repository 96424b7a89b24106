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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, llm_caption_text, preset_builder, run_lora_step_bench  # noqa: E402
from library.families.zimage.configs import PRESETS, transformer_config  # noqa: E402
from library.families.zimage.options import ZImageFlowOptions, ZImageOptions  # noqa: E402


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    latent = latents.shape[-1]
    text = llm_caption_text(a.tokens, PRESETS["random:zimage"].qwen_hidden)
    caption_states = text["hidden_state"][text["attention_mask"].bool()].to(device, dtype)

    def loss(noisy, sigma, noise, x0):
        out = transformer([noisy[0].unsqueeze(1)], (1 - sigma).to(dtype), [caption_states], return_dict=False)[0]
        return F.mse_loss(-out[0].squeeze(1).float()[None], (noise - x0).float())

    return StepInputs(text, loss, f"{latent * latent // 4} image + {a.tokens // 4} text tokens")


BENCH = LoraStepBench(
    family="zimage",
    sizes={"blocks": (2, "main layers (Z-Image: 30)"),
           "tokens": (512, "Qwen3 tokens per caption, padded (default 512)")},
    what="random:zimage's DiT with {blocks} main layers",
    model=preset_builder("ZImageTransformer2DModel", transformer_config, PRESETS["random:zimage"], layers="blocks"),
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way)
    options=lambda a: ZImageOptions(flow=ZImageFlowOptions(timestep_sampling="uniform", discrete_flow_shift=1.0)),
    inputs=inputs)

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
