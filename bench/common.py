"""Shared pieces of the step benchmarks: timing, interleaved comparison, peak memory, and the one runner of the
rectified-flow DiTs' LoRA step benches (`LoraStepBench`: what differs from family to family, as data).

On a shared machine wall time swings with other load, so each step is timed in wall
and in process CPU seconds, the two variants alternate step by step, and the medians
are compared. The CPU-time ratio is the steadier one on a busy CPU; on an idle machine
or an accelerator the wall-time ratio is the one that counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Union

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


def compare_steps(reference: Callable[[], None], ours: Callable[[], None], steps: int, warmup: int,
                  reference_layout: Callable[[], None] | None = None, ours_layout: Callable[[], None] | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Median (wall, cpu) seconds per step of both, alternating one step of each `steps` times (`*_layout`, untimed,
    before each: see compare_steps_min)."""
    reference_layout = reference_layout or (lambda: None)
    ours_layout = ours_layout or (lambda: None)
    for _ in range(warmup):
        reference_layout()
        reference()
        ours_layout()
        ours()
    ref, our = [], []
    for _ in range(steps):
        reference_layout()
        ref.append(timed_once(reference))
        ours_layout()
        our.append(timed_once(ours))
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    return {"reference": (med(ref, 0), med(ref, 1)), "ours": (med(our, 0), med(our, 1))}


def compare_steps_min(bare: Callable[[], None], ours: Callable[[], None], steps: int, warmup: int,
                      bare_layout: Callable[[], None] | None = None, ours_layout: Callable[[], None] | None = None
                      ) -> dict[str, tuple[float, float]]:
    """As bench_train_step.py measures: the two alternate step by step (`*_layout` switches the model's memory
    layout between them, untimed), and the minimum (wall, CPU) seconds of each over `steps` is returned (other load
    on a shared machine only ever adds time)."""
    bare_t, ours_t = [], []
    for i in range(warmup + steps):
        if bare_layout is not None:
            bare_layout()
        b = timed_once(bare)
        if ours_layout is not None:
            ours_layout()
        o = timed_once(ours)
        if i >= warmup:
            bare_t.append(b)
            ours_t.append(o)
    return {"reference": (min(x[0] for x in bare_t), min(x[1] for x in bare_t)),
            "ours": (min(x[0] for x in ours_t), min(x[1] for x in ours_t))}


def print_min_comparison(result: dict[str, tuple[float, float]], goal: float) -> None:
    """compare_steps_min's figures, and ours / bare in wall and CPU time against `goal`."""
    (rw, rc), (ow, oc) = result["reference"], result["ours"]
    print(f"bare step (min):  {rw:.3f} s wall, {rc:.3f} s CPU")
    print(f"our step (min):   {ow:.3f} s wall, {oc:.3f} s CPU")
    print(f"ours/bare:        {ow / rw:.3f} wall, {oc / rc:.3f} CPU  (goal <= {goal:.2f}); load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"peak RSS:         {peak_rss_mib():.0f} MiB")


def to_nchw(model: torch.nn.Module) -> None:
    """Frozen convolutions back to the default (NCHW) layout, for the bare step."""
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and not m.weight.is_contiguous():
            m.weight.data = m.weight.data.contiguous()


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


CAPTION = "a photo of a sks dog sitting on a wooden chair, high quality"


def one_caption_batch(latents: torch.Tensor) -> dict:
    """The batch both steps train on: `latents` (1, C, h, w) with CAPTION, unweighted, no masks."""
    return {"latents": latents, "captions": [CAPTION], "loss_weights": torch.ones(1), "masks": None}


def add_step_arguments(p, steps: int, resolution: int, resolution_help: str | None = None,
                       dtype_option: bool = True) -> None:
    """The options every denoiser step bench shares: --steps, --warmup, --resolution, --dim (LoRA rank),
    --device and, with `dtype_option`, --dtype (bf16 or fp32 base weights; bf16 without it)."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--resolution", type=int, default=resolution, help=resolution_help)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--device", default="cpu")
    if dtype_option:
        p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                       help="base weights (fp32: CPUs without bf16)")


def seeded_dtype_device(a) -> tuple[torch.dtype, torch.device]:
    """Seeds torch with 0 and returns (--dtype, bf16 where there is none, --device) of the parsed arguments."""
    torch.manual_seed(0)
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[getattr(a, "dtype", "bf16")], torch.device(a.device)


def frozen_in_dtype(factory: Callable[[], torch.nn.Module], dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """factory()'s model built with `seed` directly in `dtype` (no fp32 copy first), in eval mode, frozen."""
    from library.families.common.tiny import build_seeded

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_seeded(factory, seed)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def built(what: str, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """build()'s model, after printing how long it took and the peak RSS so far."""
    t0 = time.perf_counter()
    model = build()
    print(f"built {what} in {time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_mib():.0f} MiB")
    return model


def uniform_sigma(device) -> torch.Tensor:
    return torch.rand(1, device=device)


def logit_normal_sigma(device) -> torch.Tensor:
    """σ = sigmoid(n), n standard normal (sd-scripts' "sigmoid" timestep sampling, SD3's logit_normal weighting)."""
    return torch.sigmoid(torch.randn(1, device=device))


def bare_flow_step(latents: torch.Tensor, device, dtype: torch.dtype, optimizer,
                   loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                   draw_sigma: Callable[[torch.device], torch.Tensor] = uniform_sigma) -> Callable[[], None]:
    """The bare reference step of a rectified-flow model: σ = draw_sigma(device), x_σ = (1 - σ)·x0 + σ·ε by hand
    in `dtype`, loss(x_σ, σ, ε, x0) (the model's forward and its MSE), backward, optimizer step, zero_grad."""

    def step() -> None:
        x0 = latents.to(device)
        noise = torch.randn_like(x0)
        sigma = draw_sigma(device)
        noisy = ((1 - sigma) * x0 + sigma * noise).to(dtype)
        loss(noisy, sigma, noise, x0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def lora_formula(network, fused: bool) -> Callable[[], None]:
    """A layout switch for compare_steps*: the network's LoRA modules compute with the fused products
    (networks/lora_matmul.py, as the trainer runs them by default) or with the plain formula org(x) + up(down(x)) *
    scale (the bare step: sd-scripts' and peft's LoRA), on the same parameters."""
    modules = [m for m in network.modules() if hasattr(m, "fused_matmul")]

    def switch() -> None:
        for module in modules:
            module.fused_matmul = fused

    return switch


def compare_and_print(reference: Callable[[], None], ours: Callable[[], None], a, setup: str, network=None
                      ) -> dict[str, tuple[float, float]]:
    """compare_steps over --steps / --warmup (the bare step with `network`'s plain LoRA formula, ours fused),
    then `setup` (what was measured) and print_comparison's lines."""
    layouts = (lora_formula(network, False), lora_formula(network, True)) if network is not None else ()
    result = compare_steps(reference, ours, a.steps, a.warmup, *layouts)
    print(setup)
    print_comparison(result)
    return result


def lora_components(family, denoiser, options, dim: int, device):
    """(Components of the denoiser alone with `options`, denoiser_lora's (network, params, optimizer, scheduler))."""
    from library.families.base import Components

    comps = Components(denoiser, vae=None, text_encoders=[], tokenizers=[], options=options)
    return comps, denoiser_lora(family, comps, denoiser, dim, device)


def compare_lora_steps(family, comps, lora: tuple, latents: torch.Tensor, text: dict, loss, a, dtype, device,
                       setup: str, draw_sigma: Callable[[torch.device], torch.Tensor] = uniform_sigma,
                       lora_on: str = "transformer", batch: Optional[dict] = None) -> dict[str, tuple[float, float]]:
    """bare_flow_step(loss) against the trainer's step (cached_text_step with CAPTION's `text` on
    one_caption_batch(latents), plus `batch`'s entries, e.g. control_latents), both training `lora`, then
    compare_and_print with "LoRA modules: N `lora_on`; `setup`"; returns compare_steps' medians."""
    network, params, optimizer, scheduler = lora
    reference = bare_flow_step(latents, device, dtype, optimizer, loss, draw_sigma)
    ours = cached_text_step(family, comps, device, dtype, {CAPTION: text},
                            {**one_caption_batch(latents), **(batch or {})}, params, optimizer, scheduler)
    return compare_and_print(reference, ours, a, f"LoRA modules: {len(network.unet_loras)} {lora_on}; {setup}",
                             network)


def llm_caption_text(tokens: int, hidden: int) -> dict:
    """A cached LLM text output of `tokens` padded tokens (random second-to-last hidden states, zero ids), a quarter
    of them the caption's (as most are), as the Z-Image and Lumina caches hold it."""
    mask = torch.zeros(tokens, dtype=torch.long)
    mask[: tokens // 4] = 1
    return {"hidden_state": torch.randn(tokens, hidden), "input_ids": torch.zeros(tokens, dtype=torch.long),
            "attention_mask": mask}


def preset_model(model_class, config: Callable, preset, dtype: torch.dtype, **sizes) -> torch.nn.Module:
    """model_class(**config(preset with `sizes` replaced)) built directly in `dtype`, frozen (frozen_in_dtype)."""
    return frozen_in_dtype(lambda: model_class(**config(dataclasses.replace(preset, **sizes))), dtype)


def preset_builder(class_name: str, config: Callable, preset, **sizes: str
                   ) -> Callable[[argparse.Namespace, torch.dtype], torch.nn.Module]:
    """LoraStepBench.model for diffusers' `class_name` made by preset_model, each field of `sizes` taken from the
    argument it names (layers="blocks": the preset's layers = --blocks)."""

    def build(a: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
        import diffusers

        return preset_model(getattr(diffusers, class_name), config, preset, dtype,
                            **{name: getattr(a, arg) for name, arg in sizes.items()})

    return build


class StepInputs(NamedTuple):
    """What both steps of a LoRA step bench train on, besides the latents."""

    text: dict  # the cached text-encoder outputs of CAPTION (the trainer's step reads them)
    loss: Callable  # the bare reference's loss(x_σ, σ, ε, x0): the model's forward as its pipeline calls it, the MSE
    tokens: str  # "N image + M text tokens", for the setup line
    batch: Optional[dict] = None  # more entries of the trainer's batch (e.g. control_latents), or None


@dataclass(frozen=True)
class LoraStepBench:
    """One rectified-flow DiT's LoRA step bench (run_lora_step_bench): what differs from family to family."""

    family: Union[str, Callable[[argparse.Namespace], str]]  # the registry name (or one chosen by the arguments)
    sizes: dict  # its own int arguments: name -> (default, help), e.g. {"blocks": (2, "main layers (Z-Image: 30)")}
    what: Union[str, Callable[[argparse.Namespace], str]]  # what `model` builds ("{blocks}" from the arguments)
    model: Callable[[argparse.Namespace, torch.dtype], torch.nn.Module]  # the denoiser, built directly in the dtype
    options: Callable[[argparse.Namespace], object]  # the family's options (σ drawn as the reference draws it)
    # (arguments, model, latents, dtype, device) -> StepInputs
    inputs: Callable[[argparse.Namespace, torch.nn.Module, torch.Tensor, torch.dtype, torch.device], StepInputs]
    latent_channels: int = 16
    vae_scale: int = 8  # image side / latent side
    choices: dict = field(default_factory=dict)  # its own choice arguments, before the sizes: name -> (default, ...)
    steps: int = 4
    resolution: int = 64
    resolution_help: Optional[str] = None
    dtype_option: bool = True  # --dtype bf16 / fp32; without it bf16
    draw_sigma: Callable[[torch.device], torch.Tensor] = uniform_sigma
    lora_on: str = "transformer"


def run_lora_step_bench(bench: LoraStepBench, argv: Optional[list[str]] = None) -> dict[str, tuple[float, float]]:
    """Parse the bench's arguments (its own, then add_step_arguments'), build its model in the dtype with a LoRA on
    it (lora_components), draw the latents of --resolution, and compare_lora_steps on them and the bench's inputs;
    returns compare_steps' medians."""
    from library.families import get_family

    p = argparse.ArgumentParser()
    for name, options in bench.choices.items():
        p.add_argument(f"--{name}", choices=options, default=options[0])
    for name, (default, text) in bench.sizes.items():
        p.add_argument(f"--{name}", type=int, default=default, help=text)
    add_step_arguments(p, bench.steps, bench.resolution, bench.resolution_help, bench.dtype_option)
    a = p.parse_args(argv)
    dtype, device = seeded_dtype_device(a)
    dtype_name = getattr(a, "dtype", "bf16")

    family = get_family(bench.family(a) if callable(bench.family) else bench.family)
    options = bench.options(a)
    what = bench.what(a) if callable(bench.what) else bench.what.format(**vars(a))
    model = built(f"{what} ({dtype_name})", lambda: bench.model(a, dtype).to(device))
    comps, lora = lora_components(family, model, options, a.dim, device)
    latent = a.resolution // bench.vae_scale
    latents = torch.randn(1, bench.latent_channels, latent, latent)
    x = bench.inputs(a, model, latents, dtype, device)
    return compare_lora_steps(family, comps, lora, latents, x.text, x.loss, a, dtype, device,
                              f"{a.resolution}x{a.resolution} ({x.tokens}), batch 1, {dtype_name}, {device}",
                              draw_sigma=bench.draw_sigma, lora_on=bench.lora_on, batch=x.batch)
