"""What tools/cache_latents.py and tools/cache_text_encoder_outputs.py share: training flags in,
one caching step of the trainer run, errors as one line."""

from __future__ import annotations

import sys
import tempfile
from typing import Callable, Optional, Sequence

from library.cli.config_file import parse_with_config_file
from library.cli.entry import (
    setup_logging,
    build_parser,
    family_for,
    settings_from_args,
)
from library.core.errors import run_tool
from library.families import get_family
from library.families.base import ModelFamily
from library.train.trainer import Trainer


def family_name(argv: Sequence[str]) -> tuple[str, list[str]]:
    """--sdxl / --flux select the family, as in sd-scripts' cache tools; the rest are training flags."""
    name = "sd"
    rest = []
    for arg in argv:
        if arg in ("--sdxl", "--flux"):
            name = arg[2:]
        elif arg != "--skip_existing":  # existing valid entries are always kept
            rest.append(arg)
    if name == "sd":  # no selector: a family the model path itself tells (SD3's SAI file, folder or preset)
        name = _detected_family(rest) or name
    return name, rest


def _detected_family(argv: Sequence[str]) -> Optional[str]:
    from library.families.detect import detect_family

    for flag, value in zip(argv, argv[1:]):
        if flag == "--pretrained_model_name_or_path":
            found = detect_family(value)
            return found if found not in ("sd", "sdxl", "flux", "chroma") else None  # those keep sd-scripts' selectors
    return None


def run_cache_tool(argv: Optional[Sequence[str]], description: str, forced_flags: list[str],
                   action: Callable, check_family: Optional[Callable] = None) -> int:
    """Parse training flags (+ `forced_flags`), build the trainer and run `action(trainer)`; exit code."""
    setup_logging()
    name, rest = family_name(list(sys.argv[1:] if argv is None else argv))

    def body() -> None:
        family = get_family(name)
        if check_family is not None:
            check_family(family)
        action(build_trainer(family, rest + forced_flags, description))

    return run_tool(body)


def build_trainer(family: ModelFamily, flags: Sequence[str], description: str = "cache") -> Trainer:
    """The trainer a training run with these flags would build (a temporary --output_dir when none is given)."""
    ns = parse_with_config_file(build_parser(description, family), list(flags))
    if not ns.output_dir:
        ns.output_dir = tempfile.mkdtemp(prefix="cache_")
    family = family_for(ns, family)  # --flux --model_type chroma: Chroma's caches
    return Trainer(family, settings_from_args(ns, family))
