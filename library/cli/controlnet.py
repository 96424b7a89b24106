"""Flags of the ControlNet scripts (train_control_net.py, sdxl_train_control_net.py, flux_train_control_net.py) and
their typed form. The scripts are full-model scripts (their saving flags) in which only the ControlNet trains."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Optional

from library.cli.options import at_least, flag
from library.core.errors import ConfigError
from library.train.settings import ControlNetOptions


@dataclass
class ControlNetFlags:
    flag_group: ClassVar[str] = "ControlNet"
    controlnet_model_name_or_path: Optional[str] = flag(
        None, "a saved ControlNet to go on training (a diffusers folder or a .safetensors file this script wrote); "
              "default: a new one copied from the model")


@dataclass
class FluxControlNetFlags:
    flag_group: ClassVar[str] = "ControlNet (FLUX.1)"
    num_double_blocks: Optional[int] = flag(None, "double blocks of the ControlNet, copied from the transformer's "
                                                  "first ones (default 2)", range=at_least(0))
    num_single_blocks: Optional[int] = flag(None, "single blocks of the ControlNet, copied from the transformer's "
                                                  "first ones (default 0)", range=at_least(0))


# Fine-tune flags that would train the model itself: the ControlNet scripts train only the ControlNet.
_REFUSED = ("train_text_encoder", "block_lr", "learning_rate_te", "learning_rate_te1", "learning_rate_te2",
            "fused_optimizer_groups", "blockwise_fused_optimizers")


def controlnet_options_from_args(ns: argparse.Namespace) -> ControlNetOptions:
    for name in _REFUSED:
        if getattr(ns, name, None):
            raise ConfigError(f"--{name}: the ControlNet scripts train the ControlNet only (the model stays "
                              "frozen); drop the flag")
    if getattr(ns, "conditioning_data_dir", None) is None and not getattr(ns, "dataset_config", None):
        raise ConfigError("--conditioning_data_dir: required with --train_data_dir (the conditioning images, named "
                          "as the training images), or set conditioning_data_dir in the --dataset_config subsets")
    return ControlNetOptions(controlnet_model_name_or_path=ns.controlnet_model_name_or_path,
                             num_double_blocks=getattr(ns, "num_double_blocks", None),
                             num_single_blocks=getattr(ns, "num_single_blocks", None))
