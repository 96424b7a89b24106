"""Training step time of our LoRA step against the bare diffusers step, measured in the same run.

Full-size SD 1.5 architecture with random weights (they cost the same to run as
trained ones), 64x64 images, batch 1, LoRA dim 8 on UNet and text encoder.

- reference: tokenize + text encoder forward, VAE-free random latents, DDPM add_noise,
  UNet forward, MSE, backward, AdamW step, on the same model and LoRA parameters.
- ours: library.train.step.batch_loss (the trainer's micro-step) + clipping + optimizer
  and scheduler step, exactly as Trainer runs them.

Prints seconds per step for both, their ratio (goal <= 1.10) and peak RSS.

    python bench/bench_train_step.py [--steps 10] [--preset random:sd15] [--resolution 64]
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

from bench.common import compare_steps, lora_optimizer, print_comparison, trainer_step  # noqa: E402
from library.families import get_family  # noqa: E402
from library.families.base import LoadOptions  # noqa: E402
from library.objectives.losses import LossOptions  # noqa: E402
from library.objectives.noise import NoiseOptions  # noqa: E402
from library.train.step import StepContext  # noqa: E402
from networks import lora  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--dim", type=int, default=8)
    a = p.parse_args()
    torch.manual_seed(0)

    family = get_family("sd")
    t0 = time.perf_counter()
    comps = family.load(LoadOptions(a.preset))
    print(f"built {a.preset} in {time.perf_counter() - t0:.1f}s")
    unet, te = comps.denoiser, comps.text_encoders[0]
    for m in (unet, te, comps.vae):
        m.requires_grad_(False)
        m.eval()
    network = lora.create_network(1.0, a.dim, a.dim, comps.vae, te, unet, lora_targets=family.lora_targets(comps))
    network.apply_to(te, unet, True, True)
    params, optimizer, scheduler = lora_optimizer(network)
    scheme = family.noise_scheme(comps)
    latent = a.resolution // 8
    latents = torch.randn(1, 4, latent, latent)
    caption = ["a photo of a sks dog sitting on a wooden chair, high quality"]

    def reference_step() -> None:
        tokens = comps.tokenizers[0](caption, padding="max_length", max_length=77, truncation=True,
                                     return_tensors="pt").input_ids
        hidden = te(tokens).last_hidden_state
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (1,))
        noisy = scheme.add_noise(latents, noise, t)
        pred = unet(noisy, t, hidden).sample
        loss = F.mse_loss(pred.float(), noise.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    ctx = StepContext(family=family, components=comps, scheme=scheme, noise=NoiseOptions(), loss=LossOptions(),
                      device=torch.device("cpu"), weight_dtype=torch.float32, clip_skip=None,
                      max_token_length=None, train_text_encoder=True, autocast=contextlib.nullcontext)
    batch = {"latents": latents, "captions": caption, "loss_weights": torch.ones(1), "masks": None}
    our_step = trainer_step(ctx, batch, params, optimizer, scheduler)

    result = compare_steps(reference_step, our_step, a.steps, a.warmup)
    print_comparison(result)


if __name__ == "__main__":
    main()
