"""Gradient checkpointing policies: step time and peak memory of none / full / attention / matmul (issue 28).

Full-size architectures with random weights (they cost what trained ones cost), a LoRA step (kohya LoRA dim 8 on
the denoiser, forward + MSE + backward + AdamW), batch 1, cached latents and text:

- sd15: the SD 1.5 U-Net, fp32, at --resolution (default 256²: a 32×32 latent);
- flux: the FLUX.1-dev transformer at full width with 2 double + 2 single blocks, bf16, --resolution² image
  (256 tokens at 256²) + --t5_tokens text tokens.

Each variant runs in its own subprocess (so each one's peak RSS is its own): it builds the model, runs --warmup
untimed steps and --steps timed ones, and reports the minimum wall / process-CPU seconds per step, the RSS before
the first step and the RSS high-water mark (getrusage; on CUDA, torch.cuda's peak allocated). Printed: each variant's
figures and its ratios to `full` (sd-scripts' --gradient_checkpointing), measured in this one run.

    OMP_NUM_THREADS=1 python bench/bench_checkpointing.py [--models sd15 flux] [--variants none full attention matmul]
        [--resolution 256] [--steps 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("none", "full", "attention", "matmul")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(model: str, a, device):
    """(denoiser with a LoRA applied, LoRA params, loss function of no arguments)."""
    import torch
    import torch.nn.functional as F

    from bench.common import frozen_in_dtype, lora_optimizer
    from networks import lora

    if model == "sd15":
        from diffusers import UNet2DConditionModel

        from library.families.sd.configs import PRESETS, unet_config
        from library.families.sd.family import UNET_CONV_TARGETS, UNET_TARGETS
        from networks.lora_targets import LoraTarget

        p = PRESETS["random:sd15"]
        dtype = torch.float32
        net = frozen_in_dtype(lambda: UNet2DConditionModel(**unet_config(p.v2, p.unet_channels, p.text_hidden)), dtype)
        targets = [LoraTarget("lora_unet", net, UNET_TARGETS, UNET_CONV_TARGETS)]
        side = a.resolution // 8
        x = torch.randn(1, 4, side, side, device=device)
        text = torch.randn(1, 77, p.text_hidden, device=device)
        t = torch.tensor([500], device=device)

        def loss():
            return F.mse_loss(net(x, t, text, return_dict=False)[0].float(), x)
    else:
        from diffusers import FluxTransformer2DModel

        from bench.common import preset_model
        from library.families.base import Components
        from library.families import get_family
        from library.families.flux.configs import PRESETS, transformer_config
        from library.families.flux.family import image_ids, pack_latents
        from library.families.flux.options import FluxOptions

        dtype = torch.bfloat16
        net = preset_model(FluxTransformer2DModel, transformer_config, PRESETS["random:flux-dev"], dtype,
                           double_blocks=2, single_blocks=2)
        comps = Components(net, vae=None, text_encoders=[], tokenizers=[], options=FluxOptions())
        targets = get_family("flux").lora_targets(comps)
        side = a.resolution // 8
        x = torch.randn(1, 16, side, side, device=device, dtype=dtype)
        packed = pack_latents(x)
        kwargs = dict(encoder_hidden_states=torch.randn(1, a.t5_tokens, 4096, device=device, dtype=dtype),
                      pooled_projections=torch.randn(1, 768, device=device, dtype=dtype),
                      timestep=torch.tensor([0.5], device=device, dtype=dtype),
                      img_ids=image_ids(side, side, device, dtype),
                      txt_ids=torch.zeros(a.t5_tokens, 3, device=device, dtype=dtype),
                      guidance=torch.ones(1, device=device, dtype=dtype), return_dict=False)

        def loss():
            return F.mse_loss(net(hidden_states=packed, **kwargs)[0].float(), packed.float())
    network = lora.create_network(1.0, 8, 8, None, [], net, lora_targets=targets)
    network.apply_to([], net, False, True)
    network.to(device)
    params, optimizer, _ = lora_optimizer(network)
    net.to(device)
    return net, params, optimizer, loss


def child(a) -> None:
    import torch

    from library.train.memory.offload_checkpoint import enable_gradient_checkpointing

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    device = torch.device(a.device)
    net, params, optimizer, loss = build(a.model, a, device)
    if a.variant == "none":
        net.train()
    else:
        enable_gradient_checkpointing(net, False, a.variant)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = rss_mib()  # the model and the LoRA; the steps' own memory is what the high-water mark adds
    for _ in range(a.warmup):
        step()
    walls, cpus = [], []
    for _ in range(a.steps):
        w, c = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    out = {"wall": min(walls), "cpu": min(cpus), "rss_before": before, "peak_rss": peak_rss_mib()}
    if device.type == "cuda":
        out["peak_cuda"] = torch.cuda.max_memory_allocated() / 2 ** 20
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["sd15", "flux"], choices=("sd15", "flux"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--t5_tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.model:
        child(a)
        return
    common = ["--resolution", str(a.resolution), "--t5_tokens", str(a.t5_tokens), "--steps", str(a.steps),
              "--warmup", str(a.warmup), "--threads", str(a.threads), "--device", a.device]
    # A fixed mmap threshold: glibc then returns every freed large tensor to the system at once, so the RSS
    # high-water mark is the peak of live memory (its default threshold grows and keeps freed heaps mapped).
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MALLOC_MMAP_THRESHOLD_": "131072"}
    print(f"{a.threads} thread(s), {a.device}, {a.resolution}², steps {a.steps} (min), warmup {a.warmup}; "
          f"load {os.getloadavg()[0]:.1f}")
    for model in a.models:
        rows = {}
        for variant in a.variants:
            r = subprocess.run([sys.executable, __file__, "--model", model, "--variant", variant, *common],
                               capture_output=True, text=True, env=env)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if r.returncode or line is None:
                print(f"{model} {variant}: failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
                continue
            rows[variant] = json.loads(line[len("RESULT "):])
        base = rows.get("full")
        print(f"\n{model}: variant | wall s | cpu s | RSS before steps MiB | peak RSS MiB | step memory MiB"
              + (" | peak CUDA MiB" if a.device != "cpu" else "") + " | vs full: cpu time, step memory")
        for variant, r in rows.items():
            mem = r["peak_rss"] - r["rss_before"] if a.device == "cpu" else r["peak_cuda"]
            ratio = ""
            if base:
                base_mem = base["peak_rss"] - base["rss_before"] if a.device == "cpu" else base["peak_cuda"]
                ratio = f" | {r['cpu'] / base['cpu']:.3f}, {mem / base_mem:.2f}" if base_mem > 0 else ""
            cuda = f" | {r['peak_cuda']:.0f}" if "peak_cuda" in r else ""
            print(f"{model} {variant} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['rss_before']:.0f} | "
                  f"{r['peak_rss']:.0f} | {mem:.0f}{cuda}{ratio}", flush=True)


if __name__ == "__main__":
    main()
