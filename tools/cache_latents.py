"""Build the latent cache ahead of time, from the same flags as the training script.

    python tools/cache_latents.py --pretrained_model_name_or_path MODEL --dataset_config data.toml [--sdxl]

A later training run with the same dataset, model and settings finds every entry valid
(the cache files carry the settings that produced them). --cache_latents_to_disk is implied.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.errors import UserError  # noqa: E402


def family_name(argv: list[str]) -> tuple[str, list[str]]:
    """--sdxl / --flux select the family, as in sd-scripts' cache tools; the rest are training flags."""
    name = "sd"
    rest = []
    for arg in argv:
        if arg in ("--sdxl", "--flux"):
            name = arg[2:]
        elif arg != "--skip_existing":  # existing valid entries are always kept
            rest.append(arg)
    return name, rest


def main(argv=None) -> int:
    from library.args.config_file import parse_with_config_file
    from library.families import get_family
    from library.train.cli import _setup_logging, build_parser, settings_from_args
    from library.train.trainer import NetworkTrainer

    _setup_logging()
    name, rest = family_name(list(sys.argv[1:] if argv is None else argv))
    try:
        family = get_family(name)
        parser = build_parser("Cache latents ahead of training", family)
        ns = parse_with_config_file(parser, rest + ["--cache_latents", "--cache_latents_to_disk"])
        if not ns.output_dir:
            ns.output_dir = tempfile.mkdtemp(prefix="cache_latents_")
        NetworkTrainer(family, settings_from_args(ns, family, parser)).cache_latents_only()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
