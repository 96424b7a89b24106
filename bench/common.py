"""Shared pieces of the step benchmarks: timing, interleaved comparison, peak memory.

On a shared machine wall time swings with other load, so each step is timed in wall
and in process CPU seconds, the two variants alternate step by step, and the medians
are compared. The CPU-time ratio is the steadier one on a busy CPU; on an idle machine
or an accelerator the wall-time ratio is the one that counts.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable

import torch


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_once(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    _sync()
    w, c = time.perf_counter(), time.process_time()
    fn()
    _sync()
    return time.perf_counter() - w, time.process_time() - c


def compare_steps(reference: Callable[[], None], ours: Callable[[], None], steps: int, warmup: int
                  ) -> dict[str, tuple[float, float]]:
    """Median (wall, cpu) seconds per step of both, alternating one step of each `steps` times."""
    for _ in range(warmup):
        reference()
        ours()
    ref, our = [], []
    for _ in range(steps):
        ref.append(timed_once(reference))
        our.append(timed_once(ours))
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    return {"reference": (med(ref, 0), med(ref, 1)), "ours": (med(our, 0), med(our, 1))}


def print_comparison(result: dict[str, tuple[float, float]]) -> None:
    (rw, rc), (ow, oc) = result["reference"], result["ours"]
    print(f"reference (bare diffusers) step: {rw:.3f} s wall, {rc:.3f} s CPU")
    print(f"our trainer step:               {ow:.3f} s wall, {oc:.3f} s CPU")
    print(f"ratio ours/reference:           {ow / rw:.3f} wall, {oc / rc:.3f} CPU  (goal <= 1.10)")
    print(f"peak RSS:                       {peak_rss_mib():.0f} MiB")
    if torch.cuda.is_available():
        print(f"peak VRAM:                      {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


def trainer_step(ctx, batch: dict, params: list, optimizer, scheduler) -> Callable[[], None]:
    """One optimizer step exactly as Trainer runs it: batch_loss, backward, then the trainer's own
    optimizer_step (clipping at 1.0, optimizer, scheduler, zero_grad)."""
    from library.train.step import batch_loss, optimizer_step

    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        loss, _ = batch_loss(ctx, batch, generator)
        loss.backward()
        optimizer_step(optimizer, scheduler, 1.0)

    return step


def lora_optimizer(network, lr: float = 1e-4):
    """(trainable params, AdamW, constant LambdaLR) over the network's parameter groups, as both steps use them."""
    groups, _ = network.prepare_optimizer_params(None, None, lr)
    params = [q for g in groups for q in g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    return params, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def denoiser_lora(family, comps, denoiser, dim: int, device):
    """A kohya LoRA on the denoiser only (alpha = dim), patched in for both steps, on `device`; with
    (params, optimizer, scheduler) of lora_optimizer."""
    from networks import lora

    network = lora.create_network(1.0, dim, dim, None, [], denoiser, lora_targets=family.lora_targets(comps))
    network.apply_to([], denoiser, False, True)
    network.to(device)
    return (network, *lora_optimizer(network))


def cached_text_step(family, comps, device, dtype, text_cache: dict, batch: dict, params: list, optimizer,
                     scheduler) -> Callable[[], None]:
    """trainer_step for a denoiser-only LoRA whose captions' text-encoder outputs come from `text_cache`
    (caption -> tensors), with the family's own noise scheme and the default noise and loss options."""
    import contextlib

    from library.objectives.losses import LossOptions
    from library.objectives.noise import NoiseOptions
    from library.train.step import StepContext

    ctx = StepContext(family=family, components=comps, scheme=family.noise_scheme(comps), noise=NoiseOptions(),
                      loss=LossOptions(), device=device, weight_dtype=dtype, clip_skip=None, max_token_length=None,
                      train_text_encoder=False, autocast=contextlib.nullcontext, text_cache=text_cache)
    return trainer_step(ctx, batch, params, optimizer, scheduler)
