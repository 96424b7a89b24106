"""The full argument parser of a LoRA training script, assembled from one module per concern."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from typing import NoReturn

from library.cli.config_file import add_config_file_arguments
from library.cli.dataset import add_dataset_arguments
from library.cli.deepspeed import add_deepspeed_arguments
from library.cli.fine_tune import (
    MODEL_FORMATS,
    add_ema_arguments,
    add_fine_tune_arguments,
    add_t5xxl_fine_tune_arguments,
)
from library.cli.memory import add_memory_arguments
from library.cli.model import add_model_arguments
from library.cli.network import add_network_arguments
from library.cli.noise_loss import add_noise_loss_arguments
from library.cli.optimizer import add_optimizer_arguments
from library.cli.options import add_option_arguments
from library.cli.sampling import add_sampling_arguments
from library.cli.text_cache import add_text_cache_arguments
from library.cli.training import add_training_arguments
from library.families.base import ModelFamily


class TrainingArgumentParser(argparse.ArgumentParser):
    """argparse as sd-scripts uses it (unambiguous abbreviations such as --network_di are accepted), but a bad
    command line is one line on stderr, with the closest flag names for an unknown one, and exit code 2:
    no usage dump of every flag (--help prints that)."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown_arguments_message(extras))
        return ns

    def flag_names(self) -> list[str]:
        return sorted({o for a in self._actions for o in a.option_strings if o.startswith("--")})

    def suggestions(self, flag: str, n: int = 3) -> list[str]:
        """The closest long flag names to `flag` (which may be written --flag=value)."""
        name = flag.split("=", 1)[0]
        close = difflib.get_close_matches(name, self.flag_names(), n=n, cutoff=0.6)
        ratio = lambda other: difflib.SequenceMatcher(None, name, other).ratio()  # noqa: E731
        return [c for c in close if ratio(c) >= ratio(close[0]) - 0.05]  # only the near-equal best ones

    def unknown_arguments_message(self, extras: list[str]) -> str:
        flags = [e for e in extras if e.startswith("-")]
        if not flags:
            return f"unexpected value{'s' if len(extras) > 1 else ''} {' '.join(extras)} (a value without a flag)"
        parts = []
        for flag in flags:
            close = self.suggestions(flag)
            hint = f"; did you mean {' or '.join(close)}?" if close else " (--help lists every flag)"
            parts.append(f"{flag.split('=', 1)[0]}{hint}")
        return f"unrecognized argument{'s' if len(flags) > 1 else ''} " + "; ".join(parts)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")

    def exit(self, status: int = 0, message=None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)


def build_network_training_parser(description: str, family=None) -> argparse.ArgumentParser:
    """Parser with the sd-scripts flags of train_network.py; a family may add its own group."""
    return _training_parser(description, family, add_network_arguments)


def build_fine_tune_parser(description: str, family=None) -> argparse.ArgumentParser:
    """Parser with the sd-scripts flags of fine_tune.py / sdxl_train.py / flux_train.py."""
    parser = _training_parser(description, family, add_fine_tune_arguments)
    if getattr(family, "fine_tune_t5xxl_encoder", None) is not None:
        add_t5xxl_fine_tune_arguments(parser)
    parser.set_defaults(save_model_as="safetensors")
    for action in parser._actions:
        if action.dest == "save_model_as":  # the family's own formats: a wrong one stops before training
            action.choices = list(getattr(family, "save_formats", MODEL_FORMATS))
            action.help = "format of saved models: single-file ckpt/safetensors (original layout) or a diffusers folder"
        if action.dest in ("full_fp16", "full_bf16"):
            action.help = action.help.replace("the network itself", "the model's weights themselves")
    return parser


def _training_parser(description: str, family, add_trained) -> argparse.ArgumentParser:
    parser = TrainingArgumentParser(description=description, allow_abbrev=True)
    add_config_file_arguments(parser)
    add_model_arguments(parser)
    add_dataset_arguments(parser)
    add_trained(parser)
    add_ema_arguments(parser)
    add_optimizer_arguments(parser)
    add_noise_loss_arguments(parser)
    add_training_arguments(parser)
    add_deepspeed_arguments(parser)
    add_memory_arguments(parser)
    add_sampling_arguments(parser)
    if family is not None:
        add_family_arguments(parser, family)
    return parser


def add_family_arguments(parser: argparse.ArgumentParser, family: ModelFamily) -> None:
    """The flags a family declares: its options dataclass and, where it supports it, the text-encoder cache."""
    if dataclasses.fields(family.options_type):
        add_option_arguments(parser.add_argument_group(f"{family.name} model"), family.options_type)
    if family.supports_text_cache:
        add_text_cache_arguments(parser)
