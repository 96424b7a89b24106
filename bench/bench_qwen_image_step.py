"""Qwen-Image LoRA training step time against the bare diffusers step, measured in the same run.

The 20B DiT at full width (hidden 3072, 24 heads of 128, joint_attention_dim 3584, the real embedders and final
layer) with fewer blocks (--blocks, default 1), so it fits a CPU machine. Random weights, bf16 base (--dtype fp32 for
CPUs without fast bf16), batch 1, cached text outputs (random Qwen2.5-VL states of --text_tokens tokens padded to
1024 as the cache holds them), musubi-tuner's networks.lora_qwen_image LoRA (the same network patched in for both
steps).

- reference: σ uniform, x_σ by hand, 2x2 packing as QwenImagePipeline._pack_latents, QwenImageTransformer2DModel
  forward on the unpadded text, MSE against ε − x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step, text from the cache, trimmed by the family) +
  clipping + optimizer and scheduler step, as Trainer runs them.
- --model_version edit-2509 (Qwen-Image-Edit-2509; edit the same with one control): --controls reference latents
  of the target's size (random, as the dataset's cached control latents) packed after the target's tokens, each
  with its own img_shapes entry, as QwenImageEditPlusPipeline calls the DiT (the reference scales them as the
  pipeline's VAE encoding does, once; ours takes the unscaled control_latents of the batch, scaled each step as
  the trainer does); only the target's tokens enter the loss. The text states stand for Qwen2.5-VL's with the
  control images (--text_tokens of them).

Prints s/step for both, their ratio (goal <= 1.05) and peak RSS (and peak CUDA memory on a GPU).

    python bench/bench_qwen_image_step.py [--model_version original|edit-2509|edit] [--controls 1] [--blocks 1]
        [--steps 3] [--text_tokens 64] [--resolution 256] [--dtype bf16|fp32] [--device cuda]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, preset_builder, run_lora_step_bench  # noqa: E402
from library.families import get_family  # noqa: E402
from library.families.qwen_image.configs import LATENT_CHANNELS, PRESETS, transformer_config  # noqa: E402
from library.families.qwen_image.family import pack  # noqa: E402
from library.families.qwen_image.options import QwenImageFlowOptions, QwenImageOptions  # noqa: E402
from library.families.qwen_image.text import QWEN_MAX_TOKENS  # noqa: E402


def inputs(a, transformer, latents: torch.Tensor, dtype: torch.dtype, device) -> StepInputs:
    pr = PRESETS["random:qwen_image"]
    latent = latents.shape[-1]
    states = torch.randn(a.text_tokens, pr.qwen_hidden)
    text = {"prompt_embeds": F.pad(states, (0, 0, 0, QWEN_MAX_TOKENS - a.text_tokens)),
            "prompt_mask": F.pad(torch.ones(a.text_tokens, dtype=torch.long), (0, QWEN_MAX_TOKENS - a.text_tokens))}
    context = states[None].to(device, dtype)
    context_mask = torch.ones(1, a.text_tokens, dtype=torch.long, device=device)
    controls = [torch.randn_like(latents) for _ in range(a.controls if a.model_version != "original" else 0)]
    if a.model_version == "edit" and len(controls) > 1:
        raise SystemExit(f"--controls {a.controls}: Qwen-Image-Edit takes 1 control image (edit-2509: 1..3)")
    family = get_family("qwen_image")
    packed_controls = [pack(family.scale_latents(c).to(device, dtype)) for c in controls]  # the pipeline's, once
    shapes = [[(1, latent // 2, latent // 2)] * (1 + len(controls))]
    target = (latent // 2) ** 2

    def loss(noisy, sigma, noise, x0):
        out = transformer(hidden_states=torch.cat([pack(noisy), *packed_controls], dim=1), timestep=sigma.to(dtype),
                          encoder_hidden_states=context, encoder_hidden_states_mask=context_mask, img_shapes=shapes,
                          return_dict=False)[0]
        return F.mse_loss(out[:, :target].float(), pack(noise - x0).float())

    if device.type == "cuda":  # the steps' peak: print_comparison's peak VRAM line
        torch.cuda.reset_peak_memory_stats(device)
    tokens = f"{target} image + " + (f"{len(controls)} x {target} reference + " if controls else "")
    return StepInputs(text, loss, f"{tokens}{a.text_tokens} text tokens",
                      {"control_latents": controls} if controls else None)


BENCH = LoraStepBench(
    family="qwen_image", choices={"model_version": ("original", "edit-2509", "edit")},
    sizes={"blocks": (1, "transformer blocks (Qwen-Image: 60)"),
           "text_tokens": (64, "valid Qwen2.5-VL tokens of the caption"),
           "controls": (1, "edit versions: control images (reference latents) per target (edit: 1, edit-2509: 1..3)")},
    what="the full-width Qwen-Image DiT ({model_version}) with {blocks} blocks",
    model=preset_builder("QwenImageTransformer2DModel", transformer_config, PRESETS["random:qwen_image"],
                         layers="blocks"),
    options=lambda a: QwenImageOptions(model_version=a.model_version,
                                       flow=QwenImageFlowOptions(timestep_sampling="uniform")),
    inputs=inputs, latent_channels=LATENT_CHANNELS, steps=3, resolution=256,
    resolution_help="image side (8x down VAE, 2x2 patches)")

if __name__ == "__main__":
    run_lora_step_bench(BENCH)
