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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, llm_caption_text, preset_builder, run_lora_step_bench  # noqa: E402
from library.families.lumina.configs import PRESETS, transformer_config  # noqa: E402
from library.families.lumina.options import LuminaFlowOptions, LuminaOptions  # noqa: E402


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    latent = latents.shape[-1]
    text = llm_caption_text(a.tokens, PRESETS["random:lumina2"].gemma_hidden)
    states = text["hidden_state"][None].to(device, dtype)
    caption_mask = text["attention_mask"][None].to(device).bool()

    def loss(noisy, sigma, noise, x0):  # Lumina's t = 1 - σ: 1 is the clean image
        out = transformer(hidden_states=noisy, timestep=(1 - sigma).to(dtype), encoder_hidden_states=states,
                          encoder_attention_mask=caption_mask, return_dict=False)[0]
        return F.mse_loss(out.float(), (x0 - noise).float())

    return StepInputs(text, loss, f"{latent * latent // 4} image + {a.tokens} text tokens")


BENCH = LoraStepBench(
    family="lumina",
    sizes={"blocks": (2, "main layers (Lumina Image 2.0: 26)"),
           "tokens": (256, "Gemma-2 tokens per caption (sd-scripts' default 256)")},
    what="random:lumina2's NextDiT with {blocks} main layers",
    model=preset_builder("Lumina2Transformer2DModel", transformer_config, PRESETS["random:lumina2"], layers="blocks"),
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way)
    options=lambda a: LuminaOptions(flow=LuminaFlowOptions(timestep_sampling="uniform", discrete_flow_shift=1.0)),
    inputs=inputs)

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
