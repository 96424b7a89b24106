"""Component-file flags for the tools that load a model (generate, merge, extract, resize): every family's
`ModelFamily.component_file_flags` (FLUX.1's --clip_l / --t5xxl / --ae, SD3's --clip_g, Anima's --qwen3, ...),
each added once, with the help text of the first family in the registry that declares it.

The training scripts get these flags through the family's options_type (library/cli/parser.py).
"""

from __future__ import annotations

import argparse
from typing import Optional

from library.cli.options import add_option_arguments
from library.families import registered_families


def component_file_flags() -> tuple[str, ...]:
    """Every family's component-file flag names, each once, in registry order."""
    names: list[str] = []
    for family in registered_families():
        names += [n for n in family.component_file_flags if n not in names]
    return tuple(names)


def add_component_file_arguments(group) -> None:
    """The component-file flags of every family: the parts a single-file denoiser does not hold."""
    seen: set[str] = set()
    for family in registered_families():
        names = tuple(n for n in family.component_file_flags if n not in seen)
        if names:
            add_option_arguments(group, family.options_type, only=names)
            seen.update(names)


def component_files(ns: argparse.Namespace) -> dict[str, Optional[str]]:
    """The component-file flags of a parsed namespace (values for library.cli.options.options_from_values)."""
    return {name: getattr(ns, name, None) for name in component_file_flags()}
