"""The loss curve of `fine_tune.py --from_scratch` on tiny:sd1 and the example data (docs/fine_tune.md).

The UNet starts from its config with seeded random weights (VAE and text encoder are the preset's);
the script trains it for --steps steps and prints the mean loss of each window of --window steps,
with the cached latents, fixed seed and AdamW, so the numbers repeat on the same machine.

    python bench/from_scratch_curve.py [--steps 200] [--window 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.config_file import parse_with_config_file  # noqa: E402
from library.cli.entry import build_parser, settings_from_args  # noqa: E402
from library.families import get_family  # noqa: E402
from library.train.trainer import Trainer  # noqa: E402
from library.train.observe.tracking import Tracker  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    a = p.parse_args()
    losses: dict[int, float] = {}
    real_log = Tracker.log

    def log(self, values, step):
        if "loss/current" in values:
            losses[step] = values["loss/current"]
        real_log(self, values, step)

    Tracker.log = log
    family = get_family("sd")
    with tempfile.TemporaryDirectory() as out:
        argv = ["--pretrained_model_name_or_path", "tiny:sd1", "--from_scratch", "--seed", "42",
                "--train_data_dir", os.path.join(ROOT, "examples", "data", "train"), "--caption_extension", ".txt",
                "--resolution", "64", "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "128",
                "--cache_latents", "--train_batch_size", "2", "--max_data_loader_n_workers", "0",
                "--optimizer_type", "AdamW", "--learning_rate", str(a.learning_rate),
                "--max_train_steps", str(a.steps), "--output_dir", out, "--output_name", "scratch"]
        ns = parse_with_config_file(build_parser("curve", family, fine_tune=True), argv)
        Trainer(family, settings_from_args(ns, family, fine_tune=True)).run()
    print(f"fine_tune.py --from_scratch, tiny:sd1, example data, batch 2, AdamW lr {a.learning_rate:g}")
    print("| steps | mean loss |\n|---|---|")
    for start in range(1, a.steps + 1, a.window):
        window = [losses[s] for s in range(start, min(start + a.window, a.steps + 1)) if s in losses]
        print(f"| {start}-{start + len(window) - 1} | {sum(window) / len(window):.4f} |")


if __name__ == "__main__":
    main()
