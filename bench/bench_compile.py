"""--torch_compile: first-step time and steady step time with and without regional compilation, same run.

    python bench/bench_compile.py [--preset random:sd15] [--backend inductor] [--steps 5] [--resolution 64]

The trainer's LoRA step (batch_loss + backward + optimizer_step) on the denoiser (random weights; full-size
SD 1.5 architecture by default), first eager, then with the family's blocks compiled as --torch_compile does
(library/train/memory/compile.py). Prints the eager step, the compiled first step (tracing + code generation) and the
compiled steady step, and the steady-state speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import lora_optimizer, timed_once, trainer_step  # noqa: E402
from library.families import get_family  # noqa: E402
from library.families.base import LoadOptions  # noqa: E402
from library.objectives.losses import LossOptions  # noqa: E402
from library.objectives.noise import NoiseOptions  # noqa: E402
from library.train.memory.compile import CompileOptions, compile_blocks  # noqa: E402
from library.train.step import StepContext  # noqa: E402
from networks import lora  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--gradient_checkpointing", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    family = get_family("sd")
    comps = family.load(LoadOptions(a.preset))
    unet, te = comps.denoiser, comps.text_encoders[0]
    for m in (unet, te, comps.vae):
        m.requires_grad_(False)
        m.eval()
    if a.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        unet.train()
    network = lora.create_network(1.0, 8, 8, comps.vae, te, unet, lora_targets=family.lora_targets(comps))
    network.apply_to(te, unet, False, True)
    params, optimizer, scheduler = lora_optimizer(network)
    ctx = StepContext(family=family, components=comps, scheme=family.noise_scheme(comps), noise=NoiseOptions(),
                      loss=LossOptions(), device=torch.device("cpu"), weight_dtype=torch.float32, clip_skip=None,
                      max_token_length=None, train_text_encoder=False, autocast=contextlib.nullcontext)
    latent = a.resolution // 8
    batch = {"latents": torch.randn(1, 4, latent, latent), "captions": ["a photo of a sks dog on a chair"],
             "loss_weights": torch.ones(1), "masks": None}
    step = trainer_step(ctx, batch, params, optimizer, scheduler)

    eager = [timed_once(step)[0] for _ in range(a.steps + 1)][1:]
    n = compile_blocks(unet, family.block_classes, CompileOptions(True, a.backend))
    first = timed_once(step)[0]
    compiled = [timed_once(step)[0] for _ in range(a.steps)]
    e, c = statistics.median(eager), statistics.median(compiled)
    print(f"{a.preset} LoRA step, {a.resolution}px, batch 1, {torch.get_num_threads()} threads, backend {a.backend}, "
          f"{n} blocks compiled{', gradient checkpointing' if a.gradient_checkpointing else ''}:")
    print(f"eager {e:.3f} s/step; compiled: first step {first:.1f} s, then {c:.3f} s/step; "
          f"steady speed-up {e / c:.3f}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
