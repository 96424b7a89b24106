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
from library.families import DEFAULT_FAMILY, get_family, selector_flags
from library.families.base import ModelFamily
from library.train.trainer import Trainer


def family_name(argv: Sequence[str]) -> tuple[str, list[str]]:
    """--sdxl / --flux (ModelFamily.selector_flag) select the family, as in sd-scripts' cache tools; the rest are
    training flags."""
    selectors = selector_flags()
    name = None
    rest = []
    for arg in argv:
        if arg in selectors:
            name = selectors[arg]
        elif arg != "--skip_existing":  # existing valid entries are always kept
            rest.append(arg)
    if name is None:  # no selector: a family the model path itself tells (SD3's SAI file, folder or preset)
        name = _detected_family(rest) or DEFAULT_FAMILY
    return name, rest


def _detected_family(argv: Sequence[str]) -> Optional[str]:
    from library.families.detect import detect_family

    for flag, value in zip(argv, argv[1:]):
        if flag == "--pretrained_model_name_or_path":
            found = detect_family(value)
            return None if found is None or _reached_by_selectors(get_family(found)) else found
    return None


def _reached_by_selectors(family) -> bool:
    """Whether sd-scripts' cache tools reach the family through their selectors (so a detected one is not used):
    the default family, one with a selector flag, or a variant of one (Chroma: --flux with --model_type)."""
    return family.name == DEFAULT_FAMILY or bool(family.selector_flag) or family.variant_of is not None


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
