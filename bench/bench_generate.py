"""Generation speed per image: base model, with a LoRA hooked in, and with the LoRA merged (--merge).

    python bench/bench_generate.py                                   # tiny:sd1, 64x64, CPU (2-core friendly)
    python bench/bench_generate.py --ckpt random:sd15 --size 512 --steps 20 --images 4 --fp16   # on a GPU

The LoRA is random (rank --rank on every text-encoder and UNet module the SD
LoRA trains). Each setting runs one untimed warm-up image, then --images
images; the hooked and merged times are printed as ratios to the base model
measured in the same run, with the largest pixel difference merged vs hooked.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.sampling.prompts import SamplePrompt  # noqa: E402
from library.train.adapters.network_apply import NetworkSpec, apply_networks  # noqa: E402
from tools import generate as tool  # noqa: E402


def random_lora(family, components, rank: int, path: str) -> None:
    from networks.lora import create_network

    c = components
    net = create_network(1.0, rank, rank, c.vae, c.text_encoders[0], c.denoiser, lora_targets=family.lora_targets(c))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in net.text_encoder_loras + net.unet_loras:
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=g) * 0.01)
    net.save_weights(path, None, {})


def run_timed(options: tool.GenerateOptions, loaded, images: int) -> tuple[float, list[str]]:
    """Seconds per image of one run of `options`, and the written paths."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    paths = tool.run(options, loaded)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / images, paths


def pixels(paths: list[str]) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sorted(paths)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default="tiny:sd1")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    dtype = torch.float16 if a.fp16 else torch.float32
    base_opts = tool.GenerateOptions(ckpt=a.ckpt, outdir="", device=a.device, dtype=dtype)
    family, components, device = tool.load_model(base_opts)
    with tempfile.TemporaryDirectory() as tmp:
        lora = os.path.join(tmp, "bench_lora.safetensors")
        random_lora(family, components, a.rank, lora)
        prompts = [SamplePrompt(f"a photo of a cat, number {i}", width=a.size, height=a.size, steps=a.steps,
                                scale=7.0, seed=i, index=i) for i in range(a.images)]

        def opts(name: str, **kw) -> tool.GenerateOptions:
            return tool.GenerateOptions(ckpt=a.ckpt, outdir=os.path.join(tmp, name), prompts=prompts,
                                        device=str(device), dtype=dtype, **kw)

        spec = [NetworkSpec("networks.lora", lora, 1.0)]
        # Merging is permanent, so it is done once on a copy (timed apart) and the merged model runs plain.
        merged_components = copy.deepcopy(components)
        start = time.perf_counter()
        apply_networks(family, merged_components, spec, True, device, dtype)
        merge_s = time.perf_counter() - start
        settings = {"base": (opts("base"), (family, components, device)),
                    "hooked": (opts("hooked", networks=spec), (family, components, device)),
                    "merged": (opts("merged"), (family, merged_components, device))}
        best = {name: float("inf") for name in settings}
        paths: dict[str, list[str]] = {}
        for repeat in range(a.repeats + 1):  # round 0 warms up; settings take turns so load changes hit all
            for name, (options, loaded) in settings.items():
                seconds, paths[name] = run_timed(options, loaded, a.images)
                if repeat:
                    best[name] = min(best[name], seconds)  # other work on the machine only ever adds time
        hooked, merged = pixels(paths["hooked"]), pixels(paths["merged"])
        base_s, hooked_s, merged_s = best["base"], best["hooked"], best["merged"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{a.ckpt} {a.size}x{a.size}, {a.steps} steps, CFG, {dtype}, rank-{a.rank} LoRA, on {name}")
    print(f"base model      {base_s:8.3f} s/image   1.00x")
    print(f"LoRA hooked     {hooked_s:8.3f} s/image   {hooked_s / base_s:.2f}x base")
    print(f"LoRA --merge    {merged_s:8.3f} s/image   {merged_s / base_s:.2f}x base "
          f"({hooked_s / merged_s:.2f}x faster than hooked; the merge itself took {merge_s:.2f} s once)")
    print(f"max pixel difference merged vs hooked: {np.abs(merged.astype(int) - hooked.astype(int)).max()} / 255")


if __name__ == "__main__":
    main()
