"""Time to scan and bucket a 20,000-image dataset, cold (no metadata cache) and warm.

Writes N small PNGs of assorted sizes with captions into a temporary `10_name` folder,
then times build_training_data twice: the first call reads every image header, the
second reuses the size cache. Prints both times and their ratio.

    python bench/bench_scan.py [--images 20000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from library.cli.dataset import DataOptions  # noqa: E402
from library.data.dataset import DataFamilyInfo, build_training_data  # noqa: E402

SIZES = [(512, 512), (640, 384), (384, 640), (768, 512), (512, 768), (1024, 256)]


def write_dataset(root: str, n: int) -> str:
    folder = os.path.join(root, "train", "10_thing")
    os.makedirs(folder)
    pixels = {s: Image.fromarray(np.full((s[1], s[0], 3), 127, np.uint8)) for s in SIZES}
    for i in range(n):
        pixels[SIZES[i % len(SIZES)]].save(os.path.join(folder, f"{i:06d}.png"), compress_level=1)
        with open(os.path.join(folder, f"{i:06d}.txt"), "w") as f:
            f.write("a thing, plain background")
    return os.path.join(root, "train")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=20000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        os.environ["LORA_TOOLKIT_CACHE_DIR"] = os.path.join(root, "cache")
        t0 = time.perf_counter()
        train = write_dataset(root, a.images)
        print(f"wrote {a.images} images in {time.perf_counter() - t0:.1f}s")
        opts = DataOptions(train_data_dir=train, caption_extension=".txt", resolution="512", enable_bucket=True,
                           seed=1)
        family = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8,
                                latent_channels=4)
        times = []
        for label in ("cold", "warm"):
            t0 = time.perf_counter()
            data = build_training_data(opts, family)
            times.append(time.perf_counter() - t0)
            print(f"{label}: {times[-1]:.2f}s for {data.num_train_images} images "
                  f"({data.batches_per_epoch()} batches/epoch)")
        print(f"warm/cold ratio: {times[1] / times[0]:.3f}")


if __name__ == "__main__":
    main()
