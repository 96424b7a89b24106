"""Build the text-encoder output cache ahead of time, from the same flags as the training script.

    python tools/cache_text_encoder_outputs.py --sdxl --pretrained_model_name_or_path MODEL --dataset_config data.toml

Writes `<stem>_te_outputs.npz` (SDXL) or `<stem>_flux_te.npz` (Flux) beside each image. A later
training run with --cache_text_encoder_outputs and the same model, captions and settings finds
every entry valid. --cache_text_encoder_outputs_to_disk is implied.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.cache_tools import run_cache_tool  # noqa: E402
from library.core.errors import UserError  # noqa: E402


def _has_text_cache(family) -> None:
    if not getattr(family, "text_cache_suffix", None):
        raise UserError(f"{family.name}: this model family has no text-encoder output cache; pass --sdxl or --flux")


def main(argv=None) -> int:
    # The encoders only run here, never train; --network_train_unet_only keeps the run's own check quiet.
    return run_cache_tool(argv, "Cache text encoder outputs ahead of training",
                          ["--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk",
                           "--network_train_unet_only"],
                          lambda trainer: trainer.cache_text_outputs_only(), _has_text_cache)


if __name__ == "__main__":
    sys.exit(main())
