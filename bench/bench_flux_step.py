"""FLUX.1 LoRA training step time against the bare diffusers step, measured in the same run.

The FLUX.1-dev transformer at full width (hidden 3072, 24 heads, the real
embedders) with fewer blocks, so it fits a CPU machine: --double / --single set
how many (the real model has 19 / 38; per-block work is the same). Random
weights, bf16 base, batch 1, cached text outputs (random CLIP pooled and T5
states of --t5_tokens tokens), transformer-only fused kohya LoRA.

- reference: rectified-flow noising by hand, 2x2 packing, FluxTransformer2DModel
  forward with guidance 1.0, MSE against noise - x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the
  cache) + clipping + optimizer and scheduler step, as Trainer runs them.

--model_type chroma (as sd-scripts' flag) measures Chroma the same way: lodestones/Chroma1-HD's transformer
(ChromaTransformer2DModel: no CLIP pooled input, no guidance, its approximator), T5 states with their attention
mask, and the reference step calling it as Chroma is called (joint text + image mask).

Prints s/step for both, their ratio (goal <= 1.10) and peak RSS.

    python bench/bench_flux_step.py [--model_type chroma] [--steps 4] [--double 1] [--single 2] [--t5_tokens 64]
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, logit_normal_sigma, run_lora_step_bench  # noqa: E402
from bench.common import frozen_in_dtype, preset_model  # noqa: E402
from library.families.chroma.family import joint_attention_mask  # noqa: E402
from library.families.chroma.configs import PRESETS as CHROMA_PRESETS  # noqa: E402
from library.families.chroma.model import (
    transformer_config as chroma_transformer_config,  # noqa: E402
)
from library.families.flux.family import image_ids, pack_latents, unpack_latents  # noqa: E402
from library.families.flux.configs import PRESETS, transformer_config  # noqa: E402
from library.families.flux.options import FluxOptions  # noqa: E402
from library.objectives.flow import FlowOptions  # noqa: E402


def build_transformer(a, dtype: torch.dtype):
    """FLUX.1-dev's (or Chroma1-HD's) transformer with --double / --single blocks, created directly in `dtype`."""
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    if a.model_type == "chroma":
        chroma = dataclasses.replace(CHROMA_PRESETS["random:chroma"], double_blocks=a.double, single_blocks=a.single)
        config = chroma_transformer_config(chroma, PRESETS["random:flux-dev"].t5_d_model)
        return frozen_in_dtype(lambda: ChromaTransformer2DModel(**config), dtype)
    return preset_model(FluxTransformer2DModel, transformer_config, PRESETS["random:flux-dev"], dtype,
                        double_blocks=a.double, single_blocks=a.single)


def options(a) -> FluxOptions:
    chroma = a.model_type == "chroma"
    return FluxOptions(guidance_scale=0.0 if chroma else 1.0, t5xxl_max_token_length=a.t5_tokens,
                       flow=FlowOptions(timestep_sampling="sigmoid"), model_type=a.model_type,
                       apply_t5_attn_mask=chroma)


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    chroma = a.model_type == "chroma"
    latent = latents.shape[-1]
    text = {"l_pooled": torch.randn(768), "t5_out": torch.randn(a.t5_tokens, 4096),
            "txt_ids": torch.zeros(a.t5_tokens, 3), "t5_attn_mask": torch.ones(a.t5_tokens)}
    if chroma:  # a caption of a quarter of the padded length, the rest masked out
        text["t5_attn_mask"][a.t5_tokens // 4:] = 0

    def loss(noisy, sigma, noise, x0):
        common = dict(hidden_states=pack_latents(noisy), encoder_hidden_states=text["t5_out"][None].to(device, dtype),
                      timestep=sigma.to(dtype), img_ids=image_ids(latent, latent, device, dtype),
                      txt_ids=text["txt_ids"].to(device, dtype), return_dict=False)
        if chroma:
            mask = joint_attention_mask(text["t5_attn_mask"][None].to(device), (latent // 2) ** 2)
            out = transformer(**common, attention_mask=mask)[0]
        else:
            out = transformer(**common, pooled_projections=text["l_pooled"][None].to(device, dtype),
                              guidance=torch.ones(1, device=device, dtype=dtype))[0]
        return F.mse_loss(unpack_latents(out, latent, latent).float(), (noise - x0).float())

    return StepInputs(text, loss, f"{latent * latent // 4} image + {a.t5_tokens} text tokens")


BENCH = LoraStepBench(
    family=lambda a: a.model_type, choices={"model_type": ("flux", "chroma")},
    sizes={"double": (1, "double blocks (FLUX.1: 19)"), "single": (2, "single blocks (FLUX.1: 38)"),
           "t5_tokens": (64, "T5 tokens per caption (dev default 512)")},
    what=lambda a: f"{'Chroma1-HD' if a.model_type == 'chroma' else 'FLUX.1-dev'} transformer with {a.double} double / "
                   f"{a.single} single blocks",
    model=build_transformer, options=options, inputs=inputs, dtype_option=False, draw_sigma=logit_normal_sigma)

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
