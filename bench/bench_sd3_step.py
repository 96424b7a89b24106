"""SD3 / SD3.5 LoRA training step time against the bare diffusers step, measured in the same run.

The MMDiT of a full-size preset (default SD3 medium: hidden 1536, 24 heads, the real embedders) at full
width with fewer joint blocks (--blocks; the last one is "pre only" as in the real model), so it fits a
CPU machine. Random weights, bf16 base, batch 1, cached text outputs (random CLIP-L / CLIP-G states and
pooled outputs, T5 states of --t5_tokens tokens), transformer-only fused kohya LoRA (the same network
patched in for both steps).

- reference: SD3 noising by hand (σ from a logit-normal draw), SD3Transformer2DModel forward on the
  concatenated context, x0 preconditioning, MSE against x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache) + clipping +
  optimizer and scheduler step, as Trainer runs them.

Prints s/step for both, their ratio (goal <= 1.05) and peak RSS.

    python bench/bench_sd3_step.py [--preset random:sd3-medium] [--blocks 2] [--steps 4] [--t5_tokens 64] [--resolution 64]
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
    logit_normal_sigma,
    lora_components,
    seeded_dtype_device,
)
from library.families import get_family  # noqa: E402
from library.families.sd3 import layout as sai  # noqa: E402
from library.families.sd3.configs import PRESETS, transformer_config  # noqa: E402
from library.families.sd3.options import SD3Options  # noqa: E402
from library.objectives.flow_sd3 import SD3FlowOptions  # noqa: E402


def build_transformer(preset: str, blocks: int, dtype: torch.dtype):
    """The preset's MMDiT with `blocks` joint blocks, created directly in `dtype`, in SAI order as loading leaves it."""
    from diffusers import SD3Transformer2DModel

    p = PRESETS[preset]
    p = dataclasses.replace(p, layers=blocks, dual_attention_layers=tuple(i for i in p.dual_attention_layers if i < blocks))
    return sai.to_sai_order(frozen_in_dtype(lambda: SD3Transformer2DModel(**transformer_config(p)), dtype))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="random:sd3-medium", choices=[n for n in PRESETS if n.startswith("random:")])
    p.add_argument("--blocks", type=int, default=2, help="joint blocks (SD3 medium: 24, SD3.5 large: 38)")
    p.add_argument("--t5_tokens", type=int, default=64, help="T5 tokens per caption (sd-scripts' default 256)")
    add_step_arguments(p, steps=4, resolution=64, dtype_option=False)
    a = p.parse_args()
    dtype, device = seeded_dtype_device(a)

    family = get_family("sd3")
    options = SD3Options(t5xxl_max_token_length=a.t5_tokens, flow=SD3FlowOptions(weighting_scheme="logit_normal"))
    transformer = built(f"the {a.preset} MMDiT with {a.blocks} joint blocks (bf16)",
                        lambda: build_transformer(a.preset, a.blocks, dtype).to(device))
    comps, lora = lora_components(family, transformer, options, a.dim, device)

    pr = PRESETS[a.preset]
    latent = a.resolution // 8
    latents = torch.randn(1, 16, latent, latent)
    text = {"l_out": torch.randn(77, pr.clip_l_hidden), "l_pooled": torch.randn(pr.clip_l_hidden),
            "clip_l_attn_mask": torch.ones(77), "g_out": torch.randn(77, pr.clip_g_hidden),
            "g_pooled": torch.randn(pr.clip_g_hidden), "clip_g_attn_mask": torch.ones(77),
            "t5_out": torch.randn(a.t5_tokens, pr.t5_d_model), "t5_attn_mask": torch.ones(a.t5_tokens)}
    lg = torch.cat([text["l_out"], text["g_out"]], dim=-1)
    context = torch.cat([F.pad(lg, (0, pr.t5_d_model - lg.shape[-1])), text["t5_out"]])[None].to(device, dtype)
    pooled = torch.cat([text["l_pooled"], text["g_pooled"]])[None].to(device, dtype)

    def loss(noisy, sigma, noise, x0):
        out = transformer(hidden_states=noisy, encoder_hidden_states=context, pooled_projections=pooled,
                          timestep=(sigma * 1000).to(dtype), return_dict=False)[0]
        return F.mse_loss(noisy.float() - sigma * out.float(), x0.float())

    compare_lora_steps(family, comps, lora, latents, text, loss, a, dtype, device,
                       f"{a.resolution}x{a.resolution} ({latent * latent // 4} image + {77 + a.t5_tokens} text "
                       f"tokens), batch 1, bf16, {device}", draw_sigma=logit_normal_sigma)


if __name__ == "__main__":
    main()
