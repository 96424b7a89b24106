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
    lora_components,
    seeded_dtype_device,
)
from library.families import get_family  # noqa: E402
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


def build_transformer(double: int, single: int, dtype: torch.dtype):
    """The full-width DiT with `double` + `single` blocks, created directly in `dtype`."""
    from diffusers import HunyuanImageTransformer2DModel

    p = dataclasses.replace(PRESETS["random:hunyuan_image"], double_blocks=double, single_blocks=single)
    return frozen_in_dtype(lambda: HunyuanImageTransformer2DModel(**transformer_config(p)), dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--double", type=int, default=1, help="double-stream blocks (the 2.1 model: 20)")
    p.add_argument("--single", type=int, default=1, help="single-stream blocks (the 2.1 model: 40)")
    p.add_argument("--text_tokens", type=int, default=64, help="valid Qwen2.5-VL tokens of the caption")
    add_step_arguments(p, steps=3, resolution=256, resolution_help="image side (the VAE is 32x down, 1x1 patches)")
    a = p.parse_args()
    dtype, device = seeded_dtype_device(a)

    family = get_family("hunyuan_image")
    options = HunyuanImageOptions(flow=HunyuanImageFlowOptions(timestep_sampling="uniform"))
    transformer = built(f"the full-width HunyuanImage DiT with {a.double} double + {a.single} single blocks "
                        f"({a.dtype})", lambda: build_transformer(a.double, a.single, dtype).to(device))
    comps, lora = lora_components(family, transformer, options, a.dim, device)

    pr = PRESETS["random:hunyuan_image"]
    latent = a.resolution // 32
    latents = torch.randn(1, LATENT_CHANNELS, latent, latent)
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

    compare_lora_steps(family, comps, lora, latents, text, loss, a, dtype, device,
                       f"{a.resolution}x{a.resolution} ({latent * latent} image + {a.text_tokens} + 1 text tokens), "
                       f"batch 1, {a.dtype}, {device}")


if __name__ == "__main__":
    main()
