"""SD 1.5 LoRA step at default flags against the bare diffusers step, measured in the same run (issue 28).

Full-size SD 1.5 architecture with random weights (they cost the same to run as trained ones), UNet-only LoRA
dim 8, cached latents, AdamW, fp32, batch 1, one thread by default.

- bare: tokenize + the frozen text encoder's forward (every step, as a naive loop and sd-scripts' SD 1.x path
  do), DDPM add_noise, UNet forward, MSE, backward, AdamW step, on the same model and LoRA parameters.
- ours: the trainer's micro-step (library.train.step.batch_loss) + clipping + optimizer and scheduler step, with
  the speed-ups the trainer turns on by default (library/train/speedups.py): the text-encoder outputs kept in
  memory once met (--no_auto_text_cache), frozen convolutions channels_last where it pays on the CPU (up to 16x16
  latents, library/train/speedups.py channels_last_pays; --no_channels_last), the LoRA'd
  Linears' products fused (networks/lora_matmul.py, --no_fused_lora; the bare step computes the same LoRA
  parameters with the plain formula org(x) + up(down(x)) * scale, as sd-scripts' and peft's LoRA do). Pass the
  same flags here to measure ours without one.

The two alternate step by step (the model's layout and the LoRA's formula are switched between them, untimed); each is timed in wall and
process CPU seconds and the minimum over the repeats is compared (the steadiest figure on a shared machine).
Prints per resolution: seconds per step, ours/bare (goal <= 0.80 at 128², <= 0.90 at 512²), load, peak RSS.

    python bench/bench_train_step.py [--resolutions 128 512] [--steps 5] [--threads 1] [--no_channels_last] ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import (  # noqa: E402
    compare_steps_min,
    denoiser_lora,
    lora_formula,
    peak_rss_mib,
    to_nchw,
    trainer_step,
)
from library.families import get_family  # noqa: E402
from library.families.base import LoadOptions  # noqa: E402
from library.objectives.losses import LossOptions  # noqa: E402
from library.objectives.noise import NoiseOptions  # noqa: E402
from library.train.speedups import SpeedOptions, channels_last_pays, frozen_convs_channels_last  # noqa: E402
from library.train.step import StepContext  # noqa: E402

GOALS = {128: 0.80, 512: 0.90}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--resolutions", type=int, nargs="+", default=[128, 512])
    p.add_argument("--steps", type=int, default=5, help="timed steps of each, interleaved")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no_auto_text_cache", action="store_true")
    p.add_argument("--no_channels_last", action="store_true")
    p.add_argument("--no_fused_lora", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    speed = SpeedOptions(auto_text_cache=not a.no_auto_text_cache, channels_last=not a.no_channels_last,
                         fused_lora=not a.no_fused_lora)

    family = get_family("sd")
    t0 = time.perf_counter()
    comps = family.load(LoadOptions(a.preset))
    print(f"built {a.preset} in {time.perf_counter() - t0:.1f}s; {a.threads} thread(s); "
          f"speed-ups: {speed}")
    unet, te = comps.denoiser, comps.text_encoders[0]
    for m in (unet, te, comps.vae):
        m.requires_grad_(False)
        m.eval()
    network, params, optimizer, scheduler = denoiser_lora(family, comps, unet, a.dim, torch.device("cpu"))
    scheme = family.noise_scheme(comps)
    caption = ["a photo of a sks dog sitting on a wooden chair, high quality"]
    ctx = StepContext(family=family, components=comps, scheme=scheme, noise=NoiseOptions(), loss=LossOptions(),
                      device=torch.device("cpu"), weight_dtype=torch.float32, clip_skip=None,
                      max_token_length=None, train_text_encoder=False, autocast=contextlib.nullcontext)
    if speed.auto_text_cache:  # as library/train/text_caching.py start_auto_text_cache sets it
        ctx.text_cache, ctx.fill_text_cache = {}, True

    def ours_layout(res: int) -> None:  # as the trainer decides it (library/train/speedups.py use_channels_last)
        if speed.channels_last and channels_last_pays(torch.device("cpu"), [(res // 8, res // 8)]):
            frozen_convs_channels_last(unet)
        ours_formula()

    bare_formula, ours_formula = lora_formula(network, False), lora_formula(network, speed.fused_lora)

    def bare_layout() -> None:
        to_nchw(unet)
        bare_formula()

    print(f"{'size':>6} {'bare s':>8} {'ours s':>8} {'wall ratio':>10} {'CPU ratio':>9} {'goal':>5}  load")
    for res in a.resolutions:
        latents = torch.randn(1, 4, res // 8, res // 8)

        def bare_step() -> None:
            tokens = comps.tokenizers[0](caption, padding="max_length", max_length=77, truncation=True,
                                         return_tensors="pt").input_ids
            with torch.no_grad():
                hidden = te(tokens).last_hidden_state
            noise = torch.randn_like(latents)
            t = torch.randint(0, 1000, (1,))
            noisy = scheme.add_noise(latents, noise, t)
            pred = unet(noisy, t, hidden).sample
            loss = F.mse_loss(pred.float(), noise.float())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        batch = {"latents": latents, "captions": caption, "loss_weights": torch.ones(1), "masks": None}
        our_step = trainer_step(ctx, batch, params, optimizer, scheduler)
        result = compare_steps_min(bare_step, our_step, a.steps, a.warmup, bare_layout, lambda: ours_layout(res))
        (bw, bc), (ow, oc) = result["reference"], result["ours"]
        goal = GOALS.get(res)
        print(f"{res:>5}² {bw:8.3f} {ow:8.3f} {ow / bw:10.3f} {oc / bc:9.3f} {goal or '-':>5}  "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
