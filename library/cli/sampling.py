"""--sample_* flags of the training scripts and their typed form; the prompt file is read here, before training."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

from library.core.errors import ConfigError
from library.sampling.prompts import load_prompts
from library.sampling.samplers import canonical_sampler, sampler_names
from library.train.sampling_hook import SampleHook, SamplingOptions

logger = logging.getLogger(__name__)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --sample_prompts, --sample_every_n_steps/epochs, --sample_at_first, --sample_sampler, ..."""
    g = parser.add_argument_group("sample images during training")
    g.add_argument("--sample_prompts", type=str, default=None,
                   help="prompt file (.txt, .toml or .json) with inline options --n --w --h --d --s --l --g --ss")
    g.add_argument("--sample_every_n_steps", type=int, default=None, help="sample every N steps")
    g.add_argument("--sample_every_n_epochs", type=int, default=None,
                   help="sample after every N epochs (may be combined with --sample_every_n_steps)")
    g.add_argument("--sample_at_first", action="store_true", help="also sample before the first step")
    g.add_argument("--sample_sampler", type=str, default=None, choices=sampler_names(),
                   help="sampler for prompts without --ss (default: the model's, ddim for SD)")
    g.add_argument("--sample_batch_size", type=int, default=1,
                   help="prompts with the same size, steps and scale generated together (default 1)")
    g.add_argument("--no_sample_grid", action="store_true",
                   help="do not write the contact sheet of each sampling event (sample/<name>_<step>_grid.png)")


def _interval(ns: argparse.Namespace, name: str) -> Optional[int]:
    value = getattr(ns, name, None)
    if value is None or value == 0:  # GUIs write 0 for "off"
        return None
    if value < 0:
        raise ConfigError(f"--{name}: expected an integer >= 1 (or 0 for off), got {value}")
    return value


def sampling_options_from_args(ns: argparse.Namespace) -> SamplingOptions:
    """The typed sampling options; ConfigError on a bad value."""
    batch = getattr(ns, "sample_batch_size", 1)
    if batch < 1:
        raise ConfigError(f"--sample_batch_size: expected an integer >= 1, got {batch}")
    sampler = getattr(ns, "sample_sampler", None)
    return SamplingOptions(
        sample_prompts=getattr(ns, "sample_prompts", None),
        sample_every_n_steps=_interval(ns, "sample_every_n_steps"),
        sample_every_n_epochs=_interval(ns, "sample_every_n_epochs"),
        sample_at_first=bool(getattr(ns, "sample_at_first", False)),
        sample_sampler=canonical_sampler(sampler) if sampler else None,
        sample_batch_size=batch,
        sample_grid=not getattr(ns, "no_sample_grid", False))


def sampling_hook_from_args(ns: argparse.Namespace) -> Optional[SampleHook]:
    """The training hook, with the prompt file already read and checked; None when sampling is off."""
    options = sampling_options_from_args(ns)
    if not options.sample_prompts:
        if options.sample_at_first or options.sample_every_n_steps or options.sample_every_n_epochs:
            logger.warning("--sample_every_n_* / --sample_at_first given without --sample_prompts: no samples")
        return None
    try:
        prompts = load_prompts(options.sample_prompts, check_sampler=canonical_sampler)
    except ConfigError as e:
        raise ConfigError(f"--sample_prompts: {e}") from None
    if not options.enabled:  # the hook stays: a run samples when asked (library/train/control.py)
        logger.warning("--sample_prompts given without --sample_every_n_steps, --sample_every_n_epochs or "
                       "--sample_at_first: no samples unless asked during the run (the web UI's Sample now)")
    return SampleHook(options, prompts)
