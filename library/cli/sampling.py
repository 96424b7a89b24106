"""--sample_* flags of the training scripts and their typed form; the prompt file is read here, before training."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

from library.cli.options import at_least, flag, settings_from
from library.core.errors import ConfigError
from library.sampling.prompts import load_prompts
from library.sampling.samplers import canonical_sampler, sampler_names
from library.train.sampling_hook import SampleHook, SamplingOptions

logger = logging.getLogger(__name__)


@dataclass
class SamplingFlags:
    flag_group: ClassVar[str] = "sample images during training"
    sample_prompts: Optional[str] = flag(None, "prompt file (.txt, .toml or .json) with inline options --n --w --h "
                                               "--d --s --l --g --ss")
    sample_every_n_steps: Optional[int] = flag(None, "sample every N steps", range=at_least(0, "0 = off"))
    sample_every_n_epochs: Optional[int] = flag(None, "sample after every N epochs (may be combined with "
                                                      "--sample_every_n_steps)", range=at_least(0, "0 = off"))
    sample_at_first: bool = flag(False, "also sample before the first step")
    sample_sampler: Optional[str] = flag(None, "sampler for prompts without --ss (default: the model's, ddim for SD)",
                                               choices=sampler_names())
    sample_batch_size: int = flag(1, "prompts with the same size, steps and scale generated together (default 1)",
                                     range=at_least(1))
    no_sample_grid: bool = flag(False, "do not write the contact sheet of each sampling event "
                                       "(sample/<name>_<step>_grid.png)")


def sampling_options_from_args(ns: argparse.Namespace) -> SamplingOptions:
    """The typed sampling options (each flag's own range is declared)."""
    return settings_from(
        SamplingOptions, ns,
        sample_every_n_steps=ns.sample_every_n_steps or None,  # GUIs write 0 for "off"
        sample_every_n_epochs=ns.sample_every_n_epochs or None,
        sample_sampler=canonical_sampler(ns.sample_sampler) if ns.sample_sampler else None,
        sample_grid=not ns.no_sample_grid)


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
