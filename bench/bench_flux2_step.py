"""FLUX.2 klein LoRA training step time against the bare diffusers step, measured in the same run.

The DiT of random:flux2 (FLUX.2-klein-4B: 3072 wide, 24 heads of 128, text features 3 x 2560, the real embedders and
shared modulations) at full width with fewer blocks (--double, --single), so it fits a CPU machine. Random weights,
bf16 base (--dtype fp32 for CPUs without fast bf16), batch 1, cached Qwen3 outputs (random states of --tokens padded
tokens), transformer-only LoRA on the double and single blocks (the same network patched in for both steps).

- reference: the noising by hand (x_t = (1 - σ)·x0 + σ·ε, σ uniform), Flux2Transformer2DModel forward as
  diffusers' Flux2KleinPipeline calls it (its own _patchify_latents / _pack_latents / _prepare_latent_ids / _prepare_text_ids,
  t = σ, no guidance), MSE of the output against the packed ε - x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache) + clipping +
  optimizer and scheduler step, as Trainer runs them.

Prints s/step for both, their ratio (goal <= 1.05) and peak memory.

    python bench/bench_flux2_step.py [--double 1] [--single 2] [--steps 4] [--tokens 512] [--resolution 64]
        [--dtype fp32]
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


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    from diffusers import Flux2KleinPipeline as Pipe

    width = PRESETS["random:flux2"].qwen_hidden * len(TEXT_LAYERS)
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
                          timestep=sigma.to(dtype), img_ids=img_ids, txt_ids=txt_ids, guidance=None,
                          return_dict=False)[0]
        return F.mse_loss(out.float(), packed((noise - x0).float()))

    return StepInputs(text, loss, f"{latent * latent // 4} image + {a.tokens} text tokens")


BENCH = LoraStepBench(
    family="flux2",
    sizes={"double": (1, "double-stream blocks (klein 4B: 5)"), "single": (2, "single-stream blocks (klein 4B: 20)"),
           "tokens": (512, "Qwen3 tokens per caption, padded (default 512)")},
    what="random:flux2's DiT with {double} double / {single} single blocks",
    model=preset_builder("Flux2Transformer2DModel", transformer_config, PRESETS["random:flux2"], double_layers="double",
                         single_layers="single"),
    # uniform σ and the raw prediction in both steps (the reference draws σ the same way)
    options=lambda a: Flux2Options(flow=Flux2FlowOptions(timestep_sampling="uniform")),
    inputs=inputs, latent_channels=LATENT_CHANNELS)

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
