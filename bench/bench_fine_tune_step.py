"""Full fine-tune step of our trainer against a bare diffusers full fine-tune step, in the same run,
and peak memory with and without --fused_backward_pass.

Full-size architectures with random weights (they cost the same to run as trained ones): SD 1.5
(random:sd15, 860M UNet) or SDXL (random:sdxl, 2.6B UNet), small images, batch 1, the UNet trained.

- reference: text encoder forward (frozen), DDPM add_noise, UNet forward, MSE, backward,
  optimizer step, zero_grad: the loop of diffusers' train_text_to_image.py, on the same model.
- ours: ModelTrainable's parameter groups + library.train.step.batch_loss + optimizer_step
  (clipping at 1.0, optimizer, scheduler, zero_grad), exactly as the Trainer runs them.

`--memory` runs the step in two child processes, without and with --fused_backward_pass, and
prints both peak RSS values and their difference (goal: about one copy of the trained weights,
the gradients, gone). SDXL with AdamW needs about 45 GB; use --optimizer sgd on a 24 GB machine.

    python bench/bench_fine_tune_step.py [--family sd|sdxl] [--steps 4] [--optimizer adamw|sgd] [--memory]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import compare_steps, peak_rss_mib, print_comparison, trainer_step  # noqa: E402
from library.families import get_family  # noqa: E402
from library.families.base import LoadOptions  # noqa: E402
from library.objectives.losses import LossOptions  # noqa: E402
from library.objectives.noise import NoiseOptions  # noqa: E402
from library.train.optim.fused_backward import FusedBackwardOptimizer  # noqa: E402
from library.train.settings import FineTuneOptions  # noqa: E402
from library.train.step import StepContext, batch_loss  # noqa: E402
from library.train.adapters.trainables import ModelTrainable  # noqa: E402

PRESETS = {"sd": "random:sd15", "sdxl": "random:sdxl"}


def make_optimizer(kind: str, groups):
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-5, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-5)


def setup(a):
    family = get_family(a.family)
    t0 = time.perf_counter()
    comps = family.load(LoadOptions(PRESETS[a.family]))
    print(f"built {PRESETS[a.family]} in {time.perf_counter() - t0:.1f}s", flush=True)
    for m in (comps.denoiser, comps.vae, *comps.text_encoders):
        m.requires_grad_(False)
        m.eval()
    trainable = ModelTrainable(family, comps, {"denoiser": 1e-5}, FineTuneOptions(), "safetensors", None,
                               device=torch.device("cpu"), gradient_checkpointing=False)
    groups, _ = trainable.parameter_groups(1e-5)
    latent = a.resolution // 8
    batch = {"latents": torch.randn(1, 4, latent, latent), "loss_weights": torch.ones(1), "masks": None,
             "captions": ["a photo of a sks dog sitting on a wooden chair, high quality"],
             "original_sizes_hw": torch.tensor([[a.resolution, a.resolution]]),
             "crop_top_lefts": torch.tensor([[0, 0]]), "target_sizes_hw": torch.tensor([[a.resolution, a.resolution]])}
    ctx = StepContext(family=family, components=comps, scheme=family.noise_scheme(comps), noise=NoiseOptions(),
                      loss=LossOptions(), device=torch.device("cpu"), weight_dtype=torch.float32, clip_skip=None,
                      max_token_length=None, train_text_encoder=False, autocast=contextlib.nullcontext)
    return family, comps, groups, batch, ctx


def time_comparison(a) -> None:
    family, comps, groups, batch, ctx = setup(a)
    optimizer = make_optimizer(a.optimizer, groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    params = [p for g in groups for p in g["params"]]
    unet, scheme = comps.denoiser, ctx.scheme

    def reference_step() -> None:
        with torch.no_grad():
            text = family.encode_text(comps, family.tokenize(comps, batch["captions"], None), None)
        latents = family.scale_latents(batch["latents"])
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (1,))
        pred = family.predict(comps, scheme.add_noise(latents, noise, t), t, text, batch)
        F.mse_loss(pred.float(), noise.float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = compare_steps(reference_step, trainer_step(ctx, batch, params, optimizer, scheduler), a.steps, a.warmup)
    print(f"{a.family} full fine-tune ({sum(p.numel() for p in params) / 1e6:.0f}M trained parameters, "
          f"{a.optimizer}, {a.resolution}px):")
    print_comparison(result)
    del unet


def memory_child(a) -> None:
    family, comps, groups, batch, ctx = setup(a)
    if a.fused:
        optimizer = FusedBackwardOptimizer(make_optimizer(a.optimizer, groups).param_groups,
                                           lambda g: make_optimizer(a.optimizer, g), max_grad_norm=1.0)
    else:
        optimizer = make_optimizer(a.optimizer, groups)
    generator = torch.Generator().manual_seed(0)
    before = peak_rss_mib()
    for _ in range(a.steps):
        loss, _ = batch_loss(ctx, batch, generator)
        loss.backward()
        if not a.fused:
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"fused": a.fused, "peak_rss_mib": peak_rss_mib(), "after_build_mib": before}))


def memory_comparison(a) -> None:
    results = {}
    for fused in (False, True):
        cmd = [sys.executable, __file__, "--family", a.family, "--steps", "2", "--optimizer", a.optimizer,
               "--resolution", str(a.resolution), "--child"] + (["--fused"] if fused else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[fused] = json.loads(out)
    plain, fused = results[False]["peak_rss_mib"], results[True]["peak_rss_mib"]
    print(f"{a.family} full fine-tune peak RSS ({a.optimizer}, 2 steps): {plain:.0f} MiB usual, {fused:.0f} MiB "
          f"with --fused_backward_pass: {plain - fused:.0f} MiB less ({fused / plain:.3f} of usual)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=sorted(PRESETS), default="sd")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--memory", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.manual_seed(0)
    if a.child:
        memory_child(a)
    elif a.memory:
        memory_comparison(a)
    else:
        time_comparison(a)


if __name__ == "__main__":
    main()
