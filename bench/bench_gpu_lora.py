"""LoRA training throughput through the real trainer: s/step, peak memory, model TFLOP/s and MFU.

Meant for a GPU (the docs/performance.md table): full-size architectures with
random weights (random:sdxl, random:flux-dev), bf16, batch 1, latents and text
outputs cached (so the step is the denoiser's forward and backward plus the
optimizer), gradient checkpointing on. Extra trainer flags pass through, e.g.
--blocks_to_swap 18 or --fp8_base. On the CPU with a tiny preset it checks the
script itself:

    python bench/bench_gpu_lora.py --preset random:flux-dev --resolution 1024 --steps 12
    python bench/bench_gpu_lora.py --preset random:flux-dev --resolution 1024 --steps 12 -- --blocks_to_swap 18
    python bench/bench_gpu_lora.py --preset random:sdxl --resolution 1024 --steps 12
    python bench/bench_gpu_lora.py --preset tiny:flux --resolution 64 --steps 4 --mixed_precision no
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.common import peak_rss_mib  # noqa: E402
from library.families import get_family  # noqa: E402
from library.families.detect import detect_family  # noqa: E402

FAMILY_SCRIPTS = {"sd": "train_network.py", "sdxl": "sdxl_train_network.py", "flux": "flux_train_network.py"}


def write_images(folder: str, resolution: int, n: int) -> None:
    """n noise images at resolution² with a caption each (one bucket, so every step has the same shape)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (resolution, resolution, 3), dtype=np.uint8)).save(
            os.path.join(folder, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write("a photo of a sks dog sitting on a wooden chair, high quality")


def trainer_args(a: argparse.Namespace, data: str, out: str, family: str) -> list[str]:
    args = ["--pretrained_model_name_or_path", a.preset, "--train_data_dir", data, "--caption_extension", ".txt",
            "--resolution", str(a.resolution), "--train_batch_size", "1", "--max_data_loader_n_workers", "0",
            "--network_module", "networks.lora", "--network_dim", str(a.dim), "--network_alpha", str(a.dim),
            "--network_train_unet_only", "--learning_rate", "1e-4", "--max_train_steps", str(a.steps),
            "--seed", "0", "--output_dir", out, "--output_name", "bench", "--mixed_precision", a.mixed_precision,
            "--cache_latents", "--gradient_checkpointing", "--log_tflops", str(a.steps - 1)]
    if family != "sd":
        args.append("--cache_text_encoder_outputs")
    if a.device == "cpu":
        args.append("--cpu")
    return args + a.extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="random:flux-dev")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12, help="steps; the first is the FLOP-counting warm-up")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--mixed_precision", default="bf16", choices=["no", "fp16", "bf16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("extra", nargs="*", help="more trainer flags, after --")
    a = p.parse_args()
    family_name = detect_family(a.preset) or "sd"
    family = get_family(family_name)

    from library.cli.config_file import parse_with_config_file
    from library.cli.entry import build_parser, settings_from_args
    from library.train.observe.throughput import ThroughputMeter
    from library.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        write_images(os.path.join(tmp, "train", "1_bench"), a.resolution, 2)
        argv = trainer_args(a, os.path.join(tmp, "train"), os.path.join(tmp, "out"), family_name)
        parser = build_parser("bench", family)
        trainer = Trainer(family, settings_from_args(parse_with_config_file(parser, argv), family))
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        reports = []
        original = ThroughputMeter.step_done

        def capture(meter: ThroughputMeter, step: int):
            report = original(meter, step)
            if report is not None:
                reports.append((report, meter.step_flops))
            return report

        ThroughputMeter.step_done = capture  # the trainer makes its meter inside run()
        trainer.run()
    report, flops = reports[-1]
    print(f"{FAMILY_SCRIPTS[family_name]} {a.preset} {a.resolution}x{a.resolution} batch 1 {a.mixed_precision} "
          f"dim {a.dim} extra flags: {' '.join(a.extra) or '-'}")
    print(f"step: {report.line()}; {flops / 1e12:.3f} TFLOP per step")
    if a.device == "cuda":
        print(f"peak VRAM: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved")
    print(f"peak RSS: {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
