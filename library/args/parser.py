"""The full argument parser of a LoRA training script, assembled from one module per concern."""

from __future__ import annotations

import argparse

from library.args.config_file import add_config_file_arguments
from library.args.dataset import add_dataset_arguments
from library.args.memory import add_memory_arguments
from library.args.model import add_model_arguments
from library.args.network import add_network_arguments
from library.args.noise_loss import add_noise_loss_arguments
from library.args.optimizer import add_optimizer_arguments
from library.args.sampling import add_sampling_arguments
from library.args.training import add_training_arguments


def build_network_training_parser(description: str, family=None) -> argparse.ArgumentParser:
    """Parser with the sd-scripts flags of train_network.py; a family may add its own group."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    add_config_file_arguments(parser)
    add_model_arguments(parser)
    add_dataset_arguments(parser)
    add_network_arguments(parser)
    add_optimizer_arguments(parser)
    add_noise_loss_arguments(parser)
    add_training_arguments(parser)
    add_memory_arguments(parser)
    add_sampling_arguments(parser)
    if family is not None and hasattr(family, "add_arguments"):
        family.add_arguments(parser)
    return parser
