"""Flags of the network being trained (sd-scripts names and defaults) and their typed form."""

from __future__ import annotations

import argparse
from typing import Optional

from library.cli.fine_tune import METADATA_FLAGS, add_metadata_arguments
from library.core.errors import ConfigError
from library.train.settings import NetworkOptions


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the --network_* / LR / metadata flags of LoRA training to `parser`."""
    g = parser.add_argument_group("network")
    g.add_argument("--network_module", type=str, default="networks.lora",
                   help="Python module of the network to train (default: networks.lora)")
    g.add_argument("--network_dim", type=int, default=4, help="LoRA rank (default 4, as sd-scripts)")
    g.add_argument("--network_alpha", type=float, default=1,
                   help="LoRA alpha; the update is scaled by alpha/dim (default 1: scale 1/dim)")
    g.add_argument("--network_dropout", type=float, default=None,
                   help="dropout on the rank activations while training")
    g.add_argument("--network_args", type=str, default=None, nargs="*",
                   help="extra network arguments as key=value (e.g. conv_dim=8 conv_alpha=4)")
    g.add_argument("--network_weights", type=str, default=None, help="LoRA file to start training from")
    g.add_argument("--dim_from_weights", action="store_true",
                   help="take the modules, dims and alphas from --network_weights")
    g.add_argument("--base_weights", type=str, default=None, nargs="*",
                   help="LoRA files merged into the base model before training")
    g.add_argument("--base_weights_multiplier", type=float, default=None, nargs="*",
                   help="multiplier of each --base_weights file (default 1.0 each)")
    g.add_argument("--network_train_unet_only", action="store_true", help="train only the UNet LoRA")
    g.add_argument("--network_train_text_encoder_only", action="store_true",
                   help="train only the text encoder LoRA")
    g.add_argument("--unet_lr", type=float, default=None, help="learning rate of the UNet LoRA")
    g.add_argument("--text_encoder_lr", type=float, default=None, nargs="*",
                   help="learning rate of the text encoder LoRA: one value for all, or one per text encoder "
                        "(FLUX.1: CLIP-L, then T5 with train_t5xxl)")
    g.add_argument("--scale_weight_norms", type=float, default=None,
                   help="after each step, scale down modules whose update norm exceeds this (1.0 is typical)")
    g.add_argument("--no_metadata", action="store_true",
                   help="write only the minimal metadata (base model version and network settings)")
    g.add_argument("--training_comment", type=str, default=None, help="free text stored as ss_training_comment")
    g.add_argument("--network_multiplier", type=float, default=1.0,
                   help="multiplier of the LoRA while training (default 1.0)")
    add_metadata_arguments(g)


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
    """Check and convert the network flags of a parsed namespace."""
    if getattr(ns, "network_train_unet_only", False) and getattr(ns, "network_train_text_encoder_only", False):
        raise ConfigError("--network_train_unet_only and --network_train_text_encoder_only: expected at most one")
    if getattr(ns, "dim_from_weights", False) and not getattr(ns, "network_weights", None):
        raise ConfigError("--dim_from_weights: expected --network_weights to be given too")
    base = list(getattr(ns, "base_weights", None) or [])
    mult = list(getattr(ns, "base_weights_multiplier", None) or [])
    if mult and len(mult) != len(base):
        raise ConfigError(f"--base_weights_multiplier: expected {len(base)} values (one per --base_weights), "
                          f"got {len(mult)}")
    if getattr(ns, "network_dim", None) is not None and ns.network_dim < 1:
        raise ConfigError(f"--network_dim: expected an integer >= 1, got {ns.network_dim}")
    norms = getattr(ns, "scale_weight_norms", None)
    if norms is not None and norms <= 0:
        raise ConfigError(f"--scale_weight_norms: expected a number > 0, got {norms}")
    return NetworkOptions(
        network_module=getattr(ns, "network_module", "networks.lora") or "networks.lora",
        network_dim=getattr(ns, "network_dim", 4),
        network_alpha=getattr(ns, "network_alpha", 1.0),
        network_dropout=getattr(ns, "network_dropout", None),
        network_args=network_args_to_dict(getattr(ns, "network_args", None)),
        network_weights=getattr(ns, "network_weights", None),
        dim_from_weights=bool(getattr(ns, "dim_from_weights", False)),
        base_weights=base,
        base_weights_multiplier=mult or [1.0] * len(base),
        train_unet=not getattr(ns, "network_train_text_encoder_only", False),
        train_text_encoder=not getattr(ns, "network_train_unet_only", False),
        unet_lr=getattr(ns, "unet_lr", None),
        text_encoder_lr=getattr(ns, "text_encoder_lr", None) or None,
        scale_weight_norms=norms,
        no_metadata=bool(getattr(ns, "no_metadata", False)),
        training_comment=getattr(ns, "training_comment", None),
        network_multiplier=getattr(ns, "network_multiplier", 1.0),
        metadata={k: getattr(ns, k, None) for k in METADATA_FLAGS},
    )


