"""HunyuanImage 2.1 LoRA training step time against the bare diffusers step, measured in the same run.

The 17B DiT at full width (hidden 3584, 28 heads, the real token refiner, byT5 projection and embedders) with fewer
blocks (--double / --single, default one of each: 2 blocks), so it fits a CPU machine. Random weights, bf16 base (--dtype fp32 for CPUs without fast bf16),
batch 1, cached text outputs (random Qwen2.5-VL states of --text_tokens tokens padded to 1024 as the cache holds
them; a caption without quoted text, so byT5 is all masked), the fused kohya LoRA of sd-scripts'
networks.lora_hunyuan_image (the same network patched in for both steps).

- reference: σ uniform, x_σ by hand, HunyuanImageTransformer2DModel forward on the unpadded text (one masked byT5
  token, as the trimmed batch holds), MSE against ε − x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache, trimmed by the family) +
  clipping + optimizer and scheduler step, as Trainer runs them.

Prints s/step for both, their ratio (goal <= 1.10) and peak RSS.

    python bench/bench_hunyuan_image_step.py [--double 1] [--single 1] [--steps 3] [--text_tokens 64] [--resolution 256]
        [--dtype bf16|fp32]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, preset_builder, run_lora_step_bench  # noqa: E402
from library.families.hunyuan_image.configs import (  # noqa: E402
    LATENT_CHANNELS,
    PRESETS,
    transformer_config,
)
from library.families.hunyuan_image.options import (  # noqa: E402
    HunyuanImageFlowOptions,
    HunyuanImageOptions,
)
from library.families.hunyuan_image.text import BYT5_MAX_TOKENS, QWEN_MAX_TOKENS  # noqa: E402


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    pr = PRESETS["random:hunyuan_image"]
    latent = latents.shape[-1]
    vlm = torch.randn(a.text_tokens, pr.qwen_hidden)
    text = {"vlm_embed": F.pad(vlm, (0, 0, 0, QWEN_MAX_TOKENS - a.text_tokens)),
            "vlm_mask": F.pad(torch.ones(a.text_tokens, dtype=torch.long), (0, QWEN_MAX_TOKENS - a.text_tokens)),
            "byt5_embed": torch.zeros(BYT5_MAX_TOKENS, pr.byt5_d_model),
            "byt5_mask": torch.zeros(BYT5_MAX_TOKENS, dtype=torch.long), "ocr_mask": torch.tensor(False)}
    context = vlm[None].to(device, dtype)
    context_mask = torch.ones(1, a.text_tokens, dtype=torch.long, device=device)
    glyphs = torch.zeros(1, 1, pr.byt5_d_model, device=device, dtype=dtype)
    glyph_mask = torch.zeros(1, 1, dtype=torch.long, device=device)

    def loss(noisy, sigma, noise, x0):
        out = transformer(hidden_states=noisy, timestep=(sigma * 1000).floor().to(dtype), encoder_hidden_states=context,
                          encoder_attention_mask=context_mask, encoder_hidden_states_2=glyphs,
                          encoder_attention_mask_2=glyph_mask, return_dict=False)[0]
        return F.mse_loss(out.float(), (noise - x0).float())

    return StepInputs(text, loss, f"{latent * latent} image + {a.text_tokens} + 1 text tokens")


BENCH = LoraStepBench(
    family="hunyuan_image",
    sizes={"double": (1, "double-stream blocks (the 2.1 model: 20)"),
           "single": (1, "single-stream blocks (the 2.1 model: 40)"),
           "text_tokens": (64, "valid Qwen2.5-VL tokens of the caption")},
    what="the full-width HunyuanImage DiT with {double} double + {single} single blocks",
    model=preset_builder("HunyuanImageTransformer2DModel", transformer_config, PRESETS["random:hunyuan_image"],
                         double_blocks="double", single_blocks="single"),
    options=lambda a: HunyuanImageOptions(flow=HunyuanImageFlowOptions(timestep_sampling="uniform")),
    inputs=inputs, latent_channels=LATENT_CHANNELS, vae_scale=32, steps=3, resolution=256,
    resolution_help="image side (the VAE is 32x down, 1x1 patches)")

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
