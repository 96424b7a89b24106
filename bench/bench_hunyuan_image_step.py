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
from library.families.base import Components  # noqa: E402
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
from library.families.common.tiny import build_seeded  # noqa: E402


def build_transformer(double: int, single: int, dtype: torch.dtype):
    """The full-width DiT with `double` + `single` blocks, created directly in `dtype`."""
    from diffusers import HunyuanImageTransformer2DModel

    p = dataclasses.replace(PRESETS["random:hunyuan_image"], double_blocks=double, single_blocks=single)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_seeded(lambda: HunyuanImageTransformer2DModel(**transformer_config(p)), 0)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--double", type=int, default=1, help="double-stream blocks (the 2.1 model: 20)")
    p.add_argument("--single", type=int, default=1, help="single-stream blocks (the 2.1 model: 40)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--text_tokens", type=int, default=64, help="valid Qwen2.5-VL tokens of the caption")
    p.add_argument("--resolution", type=int, default=256, help="image side (the VAE is 32x down, 1x1 patches)")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="base weights (fp32: CPUs without bf16)")
    a = p.parse_args()
    torch.manual_seed(0)
    dtype, device = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype], torch.device(a.device)

    family = get_family("hunyuan_image")
    options = HunyuanImageOptions(flow=HunyuanImageFlowOptions(timestep_sampling="uniform"))
    t0 = time.perf_counter()
    transformer = build_transformer(a.double, a.single, dtype).to(device)
    print(f"built the full-width HunyuanImage DiT with {a.double} double + {a.single} single blocks ({a.dtype}) in "
          f"{time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_mib():.0f} MiB")
    comps = Components(transformer, vae=None, text_encoders=[], tokenizers=[], options=options)
    network, params, optimizer, scheduler = denoiser_lora(family, comps, transformer, a.dim, device)

    pr = PRESETS["random:hunyuan_image"]
    latent = a.resolution // 32
    latents = torch.randn(1, LATENT_CHANNELS, latent, latent)
    caption = "a photo of a sks dog sitting on a wooden chair, high quality"
    vlm = torch.randn(a.text_tokens, pr.qwen_hidden)
    text = {"vlm_embed": F.pad(vlm, (0, 0, 0, QWEN_MAX_TOKENS - a.text_tokens)),
            "vlm_mask": F.pad(torch.ones(a.text_tokens, dtype=torch.long), (0, QWEN_MAX_TOKENS - a.text_tokens)),
            "byt5_embed": torch.zeros(BYT5_MAX_TOKENS, pr.byt5_d_model),
            "byt5_mask": torch.zeros(BYT5_MAX_TOKENS, dtype=torch.long), "ocr_mask": torch.tensor(False)}
    batch = {"latents": latents, "captions": [caption], "loss_weights": torch.ones(1), "masks": None}
    context = vlm[None].to(device, dtype)
    context_mask = torch.ones(1, a.text_tokens, dtype=torch.long, device=device)
    glyphs = torch.zeros(1, 1, pr.byt5_d_model, device=device, dtype=dtype)
    glyph_mask = torch.zeros(1, 1, dtype=torch.long, device=device)

    def reference_step() -> None:
        x0 = latents.to(device)
        noise = torch.randn_like(x0)
        sigma = torch.rand(1, device=device)
        noisy = ((1 - sigma) * x0 + sigma * noise).to(dtype)
        out = transformer(hidden_states=noisy, timestep=(sigma * 1000).floor().to(dtype), encoder_hidden_states=context,
                          encoder_attention_mask=context_mask, encoder_hidden_states_2=glyphs,
                          encoder_attention_mask_2=glyph_mask, return_dict=False)[0]
        F.mse_loss(out.float(), (noise - x0).float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    our_step = cached_text_step(family, comps, device, dtype, {caption: text}, batch, params, optimizer,
                                scheduler)

    result = compare_steps(reference_step, our_step, a.steps, a.warmup)
    print(f"LoRA modules: {len(network.unet_loras)} transformer; {a.resolution}x{a.resolution} "
          f"({latent * latent} image + {a.text_tokens} + 1 text tokens), batch 1, {a.dtype}, {device}")
    print_comparison(result)


if __name__ == "__main__":
    main()
