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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, logit_normal_sigma, preset_model, run_lora_step_bench  # noqa: E402
from library.families.sd3 import layout as sai  # noqa: E402
from library.families.sd3.configs import PRESETS, transformer_config  # noqa: E402
from library.families.sd3.options import SD3Options  # noqa: E402
from library.objectives.flow_sd3 import SD3FlowOptions  # noqa: E402


def build_transformer(a, dtype: torch.dtype):
    """The --preset's MMDiT with --blocks joint blocks, created directly in `dtype`, in SAI order as loading leaves
    it."""
    from diffusers import SD3Transformer2DModel

    p = PRESETS[a.preset]
    dual = tuple(i for i in p.dual_attention_layers if i < a.blocks)
    return sai.to_sai_order(preset_model(SD3Transformer2DModel, transformer_config, p, dtype, layers=a.blocks,
                                         dual_attention_layers=dual))


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    pr = PRESETS[a.preset]
    latent = latents.shape[-1]
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

    return StepInputs(text, loss, f"{latent * latent // 4} image + {77 + a.t5_tokens} text tokens")


BENCH = LoraStepBench(
    family="sd3", choices={"preset": tuple(n for n in PRESETS if n.startswith("random:"))},
    sizes={"blocks": (2, "joint blocks (SD3 medium: 24, SD3.5 large: 38)"),
           "t5_tokens": (64, "T5 tokens per caption (sd-scripts' default 256)")},
    what="the {preset} MMDiT with {blocks} joint blocks", model=build_transformer,
    options=lambda a: SD3Options(t5xxl_max_token_length=a.t5_tokens,
                                 flow=SD3FlowOptions(weighting_scheme="logit_normal")),
    inputs=inputs, dtype_option=False, draw_sigma=logit_normal_sigma)

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
