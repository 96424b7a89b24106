"""FLUX.1 LoRA training step time against the bare diffusers step, measured in the same run.

The FLUX.1-dev transformer at full width (hidden 3072, 24 heads, the real
embedders) with fewer blocks, so it fits a CPU machine: --double / --single set
how many (the real model has 19 / 38; per-block work is the same). Random
weights, bf16 base, batch 1, transformer-only fused kohya LoRA.

The bare step as bench/bench_train_step.py (SD 1.5) defines it, and ours at default flags (issue 28):

- bare: tokenize the caption for CLIP-L and T5 and run both frozen encoders (every step, as a naive loop and
  sd-scripts without --cache_text_encoder_outputs do: CLIP-L's pooled output, T5's states of --t5_tokens
  tokens), rectified-flow noising by hand, 2x2 packing, FluxTransformer2DModel forward with guidance 1.0, MSE
  against noise - x0, backward, AdamW step.
- ours: library.train.step.batch_loss (the trainer's micro-step) + clipping + optimizer and scheduler step, as
  Trainer runs them, with the automatic text-encoder cache the trainer turns on by default (each caption encoded
  the first time it is met; --no_auto_text_cache to encode every step as the bare step does) and the fused LoRA
  products (networks/lora_matmul.py; --no_fused_lora; the bare step's LoRA computes the plain formula).

CLIP-L is full size (12 layers); T5-XXL full width (d_model 4096, 64 heads, d_ff 10240) with --t5_layers of its
24 blocks, as the transformer keeps --double / --single of its blocks. The two alternate step by step and the
minimum wall and CPU seconds of each over --steps is compared, 1 thread by default. Prints s/step for both,
ours/bare (goal <= 0.90) and peak RSS.

--model_type chroma (as sd-scripts' flag) measures Chroma's transformer step alone (run_lora_step_bench, goal
1.10): lodestones/Chroma1-HD's transformer (ChromaTransformer2DModel: no CLIP pooled input, no guidance, its
approximator), cached T5 states with their attention mask on both sides, and the reference step calling it as
Chroma is called (joint text + image mask).

    python bench/bench_flux_step.py [--steps 4] [--double 1] [--single 2] [--t5_layers 2] [--t5_tokens 64]
        [--threads 1] [--no_auto_text_cache] [--no_fused_lora]
    python bench/bench_flux_step.py --model_type chroma [--steps 4] [--double 1] [--single 2] [--t5_tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import LoraStepBench, StepInputs, logit_normal_sigma, run_lora_step_bench  # noqa: E402
from bench.common import frozen_in_dtype, preset_model  # noqa: E402
from bench.common import (  # noqa: E402
    CAPTION,
    add_step_arguments,
    bare_flow_step,
    built,
    compare_steps_min,
    lora_formula,
    denoiser_lora,
    one_caption_batch,
    print_min_comparison,
    seeded_dtype_device,
    trainer_step,
)
from library.families import get_family  # noqa: E402
from library.families.base import Components  # noqa: E402
from library.families.common.configs import text_encoder_config  # noqa: E402
from library.families.common.t5 import build_t5_tokenizer, t5_config  # noqa: E402
from library.families.common.tiny import build_tokenizer  # noqa: E402
from library.families.chroma.family import joint_attention_mask  # noqa: E402
from library.families.chroma.configs import PRESETS as CHROMA_PRESETS  # noqa: E402
from library.families.chroma.model import (
    transformer_config as chroma_transformer_config,  # noqa: E402
)
from library.families.flux.family import image_ids, pack_latents, unpack_latents  # noqa: E402
from library.families.flux.configs import PRESETS, transformer_config  # noqa: E402
from library.families.flux.options import FluxOptions  # noqa: E402
from library.objectives.flow import FlowOptions  # noqa: E402
from library.objectives.losses import LossOptions  # noqa: E402
from library.objectives.noise import NoiseOptions  # noqa: E402
from library.train.step import StepContext  # noqa: E402


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



def build_text_encoders(t5_layers: int, dtype: torch.dtype):
    """FLUX.1-dev's CLIP-L (full) and T5-XXL encoder (full width, `t5_layers` blocks) in `dtype`, frozen, with
    their tokenizers: ([clip, t5], [clip tokenizer, t5 tokenizer])."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5EncoderModel

    p = PRESETS["random:flux-dev"]
    clip_tok, t5_tok = build_tokenizer(False), build_t5_tokenizer()
    clip_cfg = CLIPTextConfig(**text_encoder_config(
        False, hidden_size=p.clip_hidden, intermediate_size=p.clip_intermediate, num_hidden_layers=12,
        vocab_size=p.clip_vocab or len(clip_tok), bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id))
    t5_cfg = t5_config(p, p.t5_vocab or len(t5_tok))
    t5_cfg.num_layers = t5_layers
    return ([frozen_in_dtype(lambda: CLIPTextModel(clip_cfg), dtype, 1),
             frozen_in_dtype(lambda: T5EncoderModel(t5_cfg), dtype, 2)], [clip_tok, t5_tok])


def flux_at_default_flags(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """FLUX.1: the bare step running both text encoders every step against ours at default flags (module docstring);
    returns compare_steps_min's minima."""
    p = argparse.ArgumentParser()
    p.add_argument("--model_type", choices=("flux",), default="flux")
    for name, (default, text) in BENCH.sizes.items():
        p.add_argument(f"--{name}", type=int, default=default, help=text)
    p.add_argument("--t5_layers", type=int, default=2, help="T5-XXL encoder blocks at full width (real: 24)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no_auto_text_cache", action="store_true")
    p.add_argument("--no_fused_lora", action="store_true")
    add_step_arguments(p, BENCH.steps, BENCH.resolution, dtype_option=False)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype, device = seeded_dtype_device(a)
    family = get_family("flux")
    transformer = built(BENCH.what(a) + " (bf16)", lambda: build_transformer(a, dtype).to(device))
    encoders, tokenizers = built(f"CLIP-L and T5-XXL with {a.t5_layers} blocks (bf16)",
                                 lambda: build_text_encoders(a.t5_layers, dtype))
    clip, t5 = (e.to(device) for e in encoders)
    comps = Components(transformer, vae=None, text_encoders=[clip, t5], tokenizers=tokenizers, options=options(a))
    network, params, optimizer, scheduler = denoiser_lora(family, comps, transformer, a.dim, device)
    latent = a.resolution // 8
    latents = torch.randn(1, 16, latent, latent)
    x = inputs(a, transformer, latents, dtype, device)

    def bare_loss(noisy, sigma, noise, x0):  # the frozen encoders run each step, then the same forward
        with torch.no_grad():
            clip_ids = tokenizers[0]([CAPTION], padding="max_length", max_length=77, truncation=True,
                                     return_tensors="pt").input_ids
            t5_ids = tokenizers[1]([CAPTION], padding="max_length", max_length=a.t5_tokens, truncation=True,
                                   return_tensors="pt").input_ids
            x.text["l_pooled"] = clip(clip_ids.to(device)).pooler_output[0]
            x.text["t5_out"] = t5(t5_ids.to(device)).last_hidden_state[0]
        return x.loss(noisy, sigma, noise, x0)

    bare = bare_flow_step(latents, device, dtype, optimizer, bare_loss, logit_normal_sigma)
    ctx = StepContext(family=family, components=comps, scheme=family.noise_scheme(comps), noise=NoiseOptions(),
                      loss=LossOptions(), device=device, weight_dtype=dtype, clip_skip=None, max_token_length=None,
                      train_text_encoder=False, autocast=contextlib.nullcontext)
    if not a.no_auto_text_cache:  # as library/train/text_caching.py start_auto_text_cache sets it
        ctx.text_cache, ctx.fill_text_cache = {}, True
    ours = trainer_step(ctx, one_caption_batch(latents), params, optimizer, scheduler)
    result = compare_steps_min(bare, ours, a.steps, a.warmup, lora_formula(network, False),
                               lora_formula(network, not a.no_fused_lora))
    print(f"LoRA modules: {len(network.unet_loras)} transformer; {a.resolution}x{a.resolution} ({x.tokens}), "
          f"batch 1, bf16, {device}, {a.threads} thread(s); auto text cache "
          f"{'off' if a.no_auto_text_cache else 'on'}, fused LoRA products {'off' if a.no_fused_lora else 'on'}")
    print_min_comparison(result, 0.90)
    return result


if __name__ == "__main__":
    if any(x in ("chroma", "--model_type=chroma") for x in sys.argv[1:]):  # the transformer step alone
        run_lora_step_bench(BENCH)
    else:
        flux_at_default_flags()
