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
from library.families.anima.configs import (  # noqa: E402
    PRESETS,
    AnimaDiT,
    adapter_config,
    transformer_config,
)
from library.families.anima.options import AnimaFlowOptions, AnimaOptions  # noqa: E402
from library.families.base import Components  # noqa: E402
from library.families.common.t5 import T5_REAL_VOCAB_SIZE  # noqa: E402
from library.families.common.tiny import build_seeded  # noqa: E402


def build_dit(blocks: int, dtype: torch.dtype) -> AnimaDiT:
    """Anima's DiT with `blocks` blocks and its full adapter, created directly in `dtype`."""
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    preset = dataclasses.replace(PRESETS["random:anima"], blocks=blocks)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        transformer = build_seeded(lambda: CosmosTransformer3DModel(**transformer_config(preset)), 0)
        adapter = build_seeded(lambda: AnimaTextConditioner(**adapter_config(preset, T5_REAL_VOCAB_SIZE)), 1)
    finally:
        torch.set_default_dtype(previous)
    return AnimaDiT(transformer, adapter).eval().requires_grad_(False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--blocks", type=int, default=2, help="DiT blocks (Anima: 28)")
    p.add_argument("--tokens", type=int, default=64, help="Qwen3 and T5 tokens per caption (default 512 in training)")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="base weights and compute (fp32 on a CPU without fast bf16 matmuls)")
    a = p.parse_args()
    torch.manual_seed(0)
    dtype, device = (torch.bfloat16 if a.dtype == "bf16" else torch.float32), torch.device(a.device)

    family = get_family("anima")
    options = AnimaOptions(qwen3_max_token_length=a.tokens, t5_max_token_length=a.tokens,
                           flow=AnimaFlowOptions(timestep_sampling="sigmoid"))
    t0 = time.perf_counter()
    dit = build_dit(a.blocks, dtype).to(device)
    print(f"built Anima DiT with {a.blocks} blocks + the 6-block LLM adapter ({a.dtype}) in "
          f"{time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_mib():.0f} MiB")
    comps = Components(dit, vae=None, text_encoders=[], tokenizers=[], options=options)
    network, params, optimizer, scheduler = denoiser_lora(family, comps, dit, a.dim, device)

    latent = a.resolution // 8
    latents = torch.randn(1, 16, latent, latent)
    caption = "a photo of a sks dog sitting on a wooden chair, high quality"
    ones = torch.ones(a.tokens, dtype=torch.long)
    text = {"prompt_embeds": torch.randn(a.tokens, 1024), "attn_mask": ones,
            "t5_input_ids": torch.randint(0, 32000, (a.tokens,)), "t5_attn_mask": ones}
    batch = {"latents": latents, "captions": [caption], "loss_weights": torch.ones(1), "masks": None}

    def reference_step() -> None:
        x0 = latents.to(device)
        noise = torch.randn_like(x0)
        sigma = torch.sigmoid(torch.randn(1, device=device))
        noisy = ((1 - sigma) * x0 + sigma * noise).to(dtype)
        context = dit.llm_adapter(text["prompt_embeds"][None].to(device, dtype), text["t5_input_ids"][None].to(device),
                                  target_attention_mask=text["t5_attn_mask"][None].to(device),
                                  source_attention_mask=text["attn_mask"][None].to(device))
        out = dit.transformer(hidden_states=noisy.unsqueeze(2), timestep=sigma.to(dtype), encoder_hidden_states=context,
                              condition_mask=torch.zeros(1, 1, 1, latent, latent, device=device, dtype=dtype),
                              return_dict=False)[0].squeeze(2)
        F.mse_loss(out.float(), (noise - x0).float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    our_step = cached_text_step(family, comps, device, dtype, {caption: text}, batch, params, optimizer,
                                scheduler)

    result = compare_steps(reference_step, our_step, a.steps, a.warmup)
    print(f"LoRA modules: {len(network.unet_loras)} DiT; {a.resolution}x{a.resolution} "
          f"({latent * latent // 4} image + {a.tokens} text tokens), batch 1, {a.dtype}, {device}")
    print_comparison(result)
    (ow, _), (rw, _) = result["ours"], result["reference"]
    print(f"Anima goal: ours/reference <= 1.05 wall; {'met' if ow / rw <= 1.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
