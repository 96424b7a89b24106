"""Flags of the network being trained (sd-scripts names and defaults) and their typed form."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from library.cli.fine_tune import MetadataFlags, metadata_from_args
from library.cli.options import (
    LEARNING_RATE,
    RATE,
    Range,
    add_flags,
    at_least,
    flag,
    flag_specs,
    flag_values,
    settings_from,
)
from library.core.errors import ConfigError
from library.train.settings import NetworkOptions


@dataclass
class NetworkFlags:
    """The --network_* / LR / metadata flags of LoRA training (sd-scripts names and defaults)."""
    flag_group: ClassVar[str] = "network"
    network_module: str = flag("networks.lora", "Python module of the network to train (default: networks.lora)")
    network_dim: int = flag(4, "LoRA rank (default 4, as sd-scripts)", range=at_least(1))
    network_alpha: float = flag(1, "LoRA alpha; the update is scaled by alpha/dim (default 1: scale 1/dim)",
                                   range=Range(lo=0))
    network_dropout: Optional[float] = flag(None, "dropout on the rank activations while training", range=RATE)
    network_args: Optional[list[str]] = flag(None, "extra network arguments as key=value (e.g. conv_dim=8 "
                                                   "conv_alpha=4)")
    network_weights: Optional[str] = flag(None, "LoRA file to start training from")
    dim_from_weights: bool = flag(False, "take the modules, dims and alphas from --network_weights")
    embeddings: Optional[list[str]] = flag(None, "textual-inversion embedding files (SD 1.x/2.x, SDXL) loaded "
                                                 "frozen before training: each one's token (the token_string it "
                                                 "records, else its file name) can be used in captions and sample "
                                                 "prompts")
    base_weights: Optional[list[str]] = flag(None, "LoRA files merged into the base model before training")
    base_weights_multiplier: Optional[list[float]] = flag(None, "multiplier of each --base_weights file (default 1.0 "
                                                                "each)", range=Range())
    network_train_unet_only: bool = flag(False, "train only the UNet LoRA")
    network_train_text_encoder_only: bool = flag(False, "train only the text encoder LoRA")
    unet_lr: Optional[float] = flag(None, "learning rate of the UNet LoRA", range=LEARNING_RATE)
    text_encoder_lr: Optional[list[float]] = flag(None, "learning rate of the text encoder LoRA: one value for all, "
                                                        "or one per text encoder (FLUX.1: CLIP-L, then T5 with "
                                                        "train_t5xxl)", range=LEARNING_RATE)
    scale_weight_norms: Optional[float] = flag(None, "after each step, scale down modules whose update norm exceeds "
                                                     "this (1.0 is typical)", range=Range(lo=0, lo_open=True))
    no_metadata: bool = flag(False, "write only the minimal metadata (base model version and network settings)")
    training_comment: Optional[str] = flag(None, "free text stored as ss_training_comment")
    network_multiplier: float = flag(1.0, "multiplier of the LoRA while training (default 1.0)", range=Range())
    metadata: MetadataFlags = field(default_factory=MetadataFlags)


@dataclass
class LLLiteFlags:
    """sdxl_train_control_net_lllite.py's own flag; --network_dim is the modules' MLP width there."""
    flag_group: ClassVar[str] = "ControlNet-LLLite"
    cond_emb_dim: Optional[int] = flag(None, "channels of the conditioning image embedding (required; sd-scripts' "
                                             "examples use 32 with --network_dim 64)", range=at_least(2))


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the --network_* / LR / metadata flags of LoRA training to `parser`."""
    add_flags(parser, flag_specs(NetworkFlags))


def network_args_to_dict(items: Optional[list[str]]) -> dict[str, str]:
    """["conv_dim=8", "conv_alpha=4"] -> {"conv_dim": "8", "conv_alpha": "4"}."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--network_args {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out


def network_options_from_args(ns: argparse.Namespace) -> NetworkOptions:
    """NetworkOptions; the checks are those of flag combinations (each flag's own range is declared)."""
    if ns.network_train_unet_only and ns.network_train_text_encoder_only:
        raise ConfigError("--network_train_unet_only and --network_train_text_encoder_only: expected at most one")
    if ns.dim_from_weights and not ns.network_weights:
        raise ConfigError("--dim_from_weights: expected --network_weights to be given too")
    for path in ns.embeddings or []:
        if not os.path.isfile(path):
            raise ConfigError(f"--embeddings {path}: no such embedding file")
    base = list(ns.base_weights or [])
    mult = list(ns.base_weights_multiplier or [])
    if mult and len(mult) != len(base):
        raise ConfigError(f"--base_weights_multiplier: expected {len(base)} values (one per --base_weights), "
                          f"got {len(mult)}")
    module, args = ns.network_module or "networks.lora", network_args_to_dict(ns.network_args)
    train_text_encoder = not ns.network_train_unet_only
    if "cond_emb_dim" in vars(ns):  # sdxl_train_control_net_lllite.py (LLLiteFlags): the network is LLLite's,
        module, args = lllite_network(module, args, ns.cond_emb_dim)  # on the UNet only
        train_text_encoder = False
    return settings_from(
        NetworkOptions, ns,
        network_module=module,  # an empty value in a config file: the default
        network_args=args,
        base_weights=base,
        base_weights_multiplier=mult or [1.0] * len(base),
        train_unet=not ns.network_train_text_encoder_only,
        train_text_encoder=train_text_encoder,
        text_encoder_lr=ns.text_encoder_lr or None,
        metadata=metadata_from_args(ns),
        embeddings=list(ns.embeddings or []),
    )


LLLITE_MODULE = "networks.control_net_lllite"


def lllite_network(module: str, args: dict[str, str], cond_emb_dim: Optional[int]) -> tuple[str, dict[str, str]]:
    """The --network_module and --network_args of a ControlNet-LLLite run: networks.control_net_lllite with
    cond_emb_dim from --cond_emb_dim."""
    if module not in ("networks.lora", LLLITE_MODULE):
        raise ConfigError(f"--network_module {module}: sdxl_train_control_net_lllite.py trains {LLLITE_MODULE} only; "
                          "drop the flag")
    if cond_emb_dim is None:
        raise ConfigError("--cond_emb_dim: required for ControlNet-LLLite (e.g. --cond_emb_dim 32 --network_dim 64)")
    if cond_emb_dim % 2:
        raise ConfigError(f"--cond_emb_dim {cond_emb_dim}: expected an even number (the embedding's first layer has "
                          "half as many channels)")
    return LLLITE_MODULE, {**args, "cond_emb_dim": str(cond_emb_dim)}
