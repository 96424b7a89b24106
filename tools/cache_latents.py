"""Build the latent cache ahead of time, from the same flags as the training script.

    python tools/cache_latents.py --pretrained_model_name_or_path MODEL --dataset_config data.toml [--sdxl]

A later training run with the same dataset, model and settings finds every entry valid
(the cache files carry the settings that produced them). --cache_latents_to_disk is implied.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.cache_tools import run_cache_tool  # noqa: E402


def main(argv=None) -> int:
    return run_cache_tool(argv, "Cache latents ahead of training", ["--cache_latents", "--cache_latents_to_disk"],
                          lambda trainer: trainer.cache_latents_only())


if __name__ == "__main__":
    sys.exit(main())
