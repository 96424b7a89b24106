"""Anima LoRA training step time against a bare diffusers step, measured in the same run.

The Anima DiT at full width (hidden 2048, 16 heads, AdaLN-LoRA 256, text 1024) and the full LLM
adapter (6 blocks, 1024 wide, T5 vocabulary), with fewer DiT blocks so it fits a CPU machine:
--blocks sets how many (the real model has 28; per-block work is the same). Random weights, bf16
base, batch 1, cached text outputs (random Qwen3 states of --tokens tokens and T5 ids), DiT-only
LoRA on sd-scripts' default modules.

- reference: rectified-flow noising by hand, the adapter and CosmosTransformer3DModel called directly
  (diffusers' classes), MSE against noise - x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache) + clipping +
  optimizer and scheduler step, as Trainer runs them.

Prints s/step for both, their ratio (goal <= 1.05) and peak RSS.

    python bench/bench_anima_step.py [--steps 4] [--blocks 2] [--tokens 64] [--resolution 64] [--device cuda]
        [--dtype fp32]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, logit_normal_sigma, run_lora_step_bench  # noqa: E402
from bench.common import frozen_in_dtype, preset_model  # noqa: E402
from library.families.anima.configs import (  # noqa: E402
    PRESETS,
    AnimaDiT,
    adapter_config,
    transformer_config,
)
from library.families.anima.options import AnimaFlowOptions, AnimaOptions  # noqa: E402
from library.families.common.t5 import T5_REAL_VOCAB_SIZE  # noqa: E402


def build_dit(a, dtype: torch.dtype) -> AnimaDiT:
    """Anima's DiT with --blocks blocks and its full adapter, created directly in `dtype`."""
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    preset = PRESETS["random:anima"]
    transformer = preset_model(CosmosTransformer3DModel, transformer_config, preset, dtype, blocks=a.blocks)
    adapter = frozen_in_dtype(lambda: AnimaTextConditioner(**adapter_config(preset, T5_REAL_VOCAB_SIZE)), dtype, seed=1)
    return AnimaDiT(transformer, adapter).eval().requires_grad_(False)


def inputs(a, dit, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    latent = latents.shape[-1]
    ones = torch.ones(a.tokens, dtype=torch.long)
    text = {"prompt_embeds": torch.randn(a.tokens, 1024), "attn_mask": ones,
            "t5_input_ids": torch.randint(0, 32000, (a.tokens,)), "t5_attn_mask": ones}

    def loss(noisy, sigma, noise, x0):
        context = dit.llm_adapter(text["prompt_embeds"][None].to(device, dtype), text["t5_input_ids"][None].to(device),
                                  target_attention_mask=text["t5_attn_mask"][None].to(device),
                                  source_attention_mask=text["attn_mask"][None].to(device))
        out = dit.transformer(hidden_states=noisy.unsqueeze(2), timestep=sigma.to(dtype), encoder_hidden_states=context,
                              condition_mask=torch.zeros(1, 1, 1, latent, latent, device=device, dtype=dtype),
                              return_dict=False)[0].squeeze(2)
        return F.mse_loss(out.float(), (noise - x0).float())

    return StepInputs(text, loss, f"{latent * latent // 4} image + {a.tokens} text tokens")


BENCH = LoraStepBench(
    family="anima",
    sizes={"blocks": (2, "DiT blocks (Anima: 28)"),
           "tokens": (64, "Qwen3 and T5 tokens per caption (default 512 in training)")},
    what="Anima DiT with {blocks} blocks + the 6-block LLM adapter", model=build_dit,
    options=lambda a: AnimaOptions(qwen3_max_token_length=a.tokens, t5_max_token_length=a.tokens,
                                   flow=AnimaFlowOptions(timestep_sampling="sigmoid")),
    inputs=inputs, draw_sigma=logit_normal_sigma, lora_on="DiT")

if __name__ == "__main__":
    result = run_lora_step_bench(BENCH)
    (ow, _), (rw, _) = result["ours"], result["reference"]
    print(f"Anima goal: ours/reference <= 1.05 wall; {'met' if ow / rw <= 1.05 else 'NOT met'}")
