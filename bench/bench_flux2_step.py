"""FLUX.2 klein / [dev] LoRA training step time against the bare diffusers step, measured in the same run.

--model klein (default): the DiT of random:flux2 (FLUX.2-klein-4B: 3072 wide, 24 heads of 128, text features
3 x 2560, the real embedders and shared modulations); --model dev: random:flux2_dev (FLUX.2-dev: 6144 wide, 48 heads
of 128, text features 3 x 5120 from Mistral-Small-3.1, the guidance embedding). Full width with fewer blocks
(--double, --single), so it fits a CPU machine. Random weights, bf16 base (--dtype fp32 for CPUs without fast bf16),
batch 1, cached text outputs (random states of --tokens padded tokens), transformer-only LoRA on the double and single
blocks (the same network patched in for both steps).

- reference: the noising by hand (x_t = (1 - σ)·x0 + σ·ε, σ uniform), Flux2Transformer2DModel forward as
  diffusers' Flux2KleinPipeline / Flux2Pipeline calls it (its own _patchify_latents / _pack_latents /
  _prepare_latent_ids / _prepare_text_ids, t = σ; klein no guidance, dev the pipeline's float32 guidance tensor at
  1.0, what training feeds), MSE of the output against the packed ε - x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache) + clipping +
  optimizer and scheduler step, as Trainer runs them.

Prints s/step for both, their ratio (goal <= 1.05) and peak memory.

    python bench/bench_flux2_step.py [--model klein|dev] [--double 1] [--single 2] [--steps 4] [--tokens 512]
        [--resolution 64] [--dtype fp32]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, llm_caption_text, preset_builder, run_lora_step_bench  # noqa: E402
from library.families.flux2.configs import LATENT_CHANNELS, PRESETS, TEXT_LAYERS, transformer_config  # noqa: E402
from library.families.flux2.options import Flux2FlowOptions, Flux2Options  # noqa: E402


PRESET = {"klein": "random:flux2", "dev": "random:flux2_dev"}
GUIDANCE = 1.0  # what training feeds dev's guidance embedding (--guidance_scale's default)


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    Pipe = Flux2Pipeline if a.model == "dev" else Flux2KleinPipeline  # the model's own pipeline's helpers
    width = PRESETS[PRESET[a.model]].text_width * len(TEXT_LAYERS)
    guidance = torch.full([1], GUIDANCE, device=device, dtype=torch.float32) if a.model == "dev" else None
    latent = latents.shape[-1]
    text = llm_caption_text(a.tokens, width)
    states = text["hidden_state"][None].to(device, dtype)
    txt_ids = Pipe._prepare_text_ids(states).to(device)

    def packed(x):
        return Pipe._pack_latents(Pipe._patchify_latents(x))

    def loss(noisy, sigma, noise, x0):
        patches = Pipe._patchify_latents(noisy.to(dtype))
        img_ids = Pipe._prepare_latent_ids(patches).to(device)
        out = transformer(hidden_states=Pipe._pack_latents(patches), encoder_hidden_states=states,
                          timestep=sigma.to(dtype), img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                          return_dict=False)[0]
        return F.mse_loss(out.float(), packed((noise - x0).float()))

    return StepInputs(text, loss, f"{latent * latent // 4} image + {a.tokens} text tokens")


def model(a, dtype: torch.dtype) -> torch.nn.Module:
    return preset_builder("Flux2Transformer2DModel", transformer_config, PRESETS[PRESET[a.model]],
                          double_layers="double", single_layers="single")(a, dtype)


BENCH = LoraStepBench(
    family="flux2", choices={"model": ("klein", "dev")},
    sizes={"double": (1, "double-stream blocks (klein 4B: 5, dev: 8)"),
           "single": (2, "single-stream blocks (klein 4B: 20, dev: 48)"),
           "tokens": (512, "Qwen3 / Mistral tokens per caption, padded (default 512)")},
    what=lambda a: f"{PRESET[a.model]}'s DiT with {a.double} double / {a.single} single blocks",
    model=model,
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way); dev: guidance 1.0
    options=lambda a: Flux2Options(guidance_scale=GUIDANCE, flow=Flux2FlowOptions(timestep_sampling="uniform")),
    inputs=inputs, latent_channels=LATENT_CHANNELS)

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
