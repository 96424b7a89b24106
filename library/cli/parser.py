"""The full argument parser of a LoRA training script, assembled from one module per concern."""

from __future__ import annotations

import argparse
import dataclasses

from library.cli.config_file import add_config_file_arguments
from library.cli.dataset import add_dataset_arguments
from library.cli.fine_tune import MODEL_FORMATS, add_ema_arguments, add_fine_tune_arguments
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


def build_network_training_parser(description: str, family=None) -> argparse.ArgumentParser:
    """Parser with the sd-scripts flags of train_network.py; a family may add its own group."""
    return _training_parser(description, family, add_network_arguments)


def build_fine_tune_parser(description: str, family=None) -> argparse.ArgumentParser:
    """Parser with the sd-scripts flags of fine_tune.py / sdxl_train.py / flux_train.py."""
    parser = _training_parser(description, family, add_fine_tune_arguments)
    parser.set_defaults(save_model_as="safetensors")
    for action in parser._actions:
        if action.dest == "save_model_as":
            action.choices = MODEL_FORMATS
            action.help = "format of saved models: single-file ckpt/safetensors (original layout) or a diffusers folder"
        if action.dest in ("full_fp16", "full_bf16"):
            action.help = action.help.replace("the network itself", "the model's weights themselves")
    return parser


def _training_parser(description: str, family, add_trained) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    add_config_file_arguments(parser)
    add_model_arguments(parser)
    add_dataset_arguments(parser)
    add_trained(parser)
    add_ema_arguments(parser)
    add_optimizer_arguments(parser)
    add_noise_loss_arguments(parser)
    add_training_arguments(parser)
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
