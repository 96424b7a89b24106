"""Build the text-encoder output cache ahead of time, from the same flags as the training script.

    python tools/cache_text_encoder_outputs.py --sdxl --pretrained_model_name_or_path MODEL --dataset_config data.toml

Writes `<stem>_te_outputs.npz` (SDXL) or `<stem>_flux_te.npz` (Flux) beside each image. A later
training run with --cache_text_encoder_outputs and the same model, captions and settings finds
every entry valid. --cache_text_encoder_outputs_to_disk is implied.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.errors import UserError  # noqa: E402
from tools.cache_latents import family_name  # noqa: E402


def main(argv=None) -> int:
    from library.args.config_file import parse_with_config_file
    from library.families import get_family
    from library.train.cli import _setup_logging, build_parser, settings_from_args
    from library.train.trainer import NetworkTrainer

    _setup_logging()
    name, rest = family_name(list(sys.argv[1:] if argv is None else argv))
    try:
        family = get_family(name)
        if not getattr(family, "text_cache_suffix", None):
            raise UserError(f"{family.name}: this model family has no text-encoder output cache; "
                            f"pass --sdxl or --flux")
        parser = build_parser("Cache text encoder outputs ahead of training", family)
        # The encoders are only run here, never trained: caching for a run that trains them is refused
        # by that run itself, so the tool need not ask for --network_train_unet_only.
        ns = parse_with_config_file(parser, rest + ["--cache_text_encoder_outputs",
                                                    "--cache_text_encoder_outputs_to_disk",
                                                    "--network_train_unet_only"])
        if not ns.output_dir:
            ns.output_dir = tempfile.mkdtemp(prefix="cache_te_")
        NetworkTrainer(family, settings_from_args(ns, family, parser)).cache_text_outputs_only()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
