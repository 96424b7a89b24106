"""FLUX.1 model flags (sd-scripts names): guidance, T5 length and mask, component files.

The memory flags (--blocks_to_swap, --fp8_base, --cpu_offload_checkpointing) are in library/args/memory.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from library.errors import ConfigError

T5_MAX_TOKENS = 512  # T5-XXL's tokenizer limit (model_max_length)


@dataclass
class FluxOptions:
    """How captions are encoded and the transformer is called."""

    guidance_scale: float = 3.5
    t5xxl_max_token_length: Optional[int] = None  # None: 512 for dev (guidance-distilled), 256 for schnell
    apply_t5_attn_mask: bool = False
    # Separate component files for a BFL single-file transformer (sd-scripts' --clip_l / --t5xxl / --ae).
    clip_l: Optional[str] = None
    t5xxl: Optional[str] = None
    ae: Optional[str] = None


def add_flux_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the FLUX.1 model flags to `parser`."""
    g = parser.add_argument_group("FLUX.1")
    g.add_argument("--guidance_scale", type=float, default=3.5,
                   help="guidance value fed to a guidance-distilled transformer (dev) during training "
                        "(sd-scripts' default 3.5; 1.0 is the usual advice for dev LoRAs)")
    g.add_argument("--t5xxl_max_token_length", type=int, default=None,
                   help="T5 tokens per caption (default: 512 for dev, 256 for schnell)")
    g.add_argument("--apply_t5_attn_mask", action="store_true",
                   help="mask T5 padding in the text encoder and in the transformer's attention")
    add_component_file_arguments(g)


COMPONENT_FILE_FLAGS = ("clip_l", "t5xxl", "ae")


def add_component_file_arguments(group) -> None:
    """--clip_l / --t5xxl / --ae: the parts a BFL single-file transformer does not hold (also for the tools)."""
    group.add_argument("--clip_l", type=str, default=None,
                       help="FLUX.1: CLIP-L text encoder file (.safetensors) for a BFL single-file transformer")
    group.add_argument("--t5xxl", type=str, default=None,
                       help="FLUX.1: T5-XXL text encoder file (.safetensors) for a BFL single-file transformer")
    group.add_argument("--ae", type=str, default=None,
                       help="FLUX.1: autoencoder file (ae.safetensors) for a BFL single-file transformer")


def component_files(ns: argparse.Namespace) -> dict[str, Optional[str]]:
    """The component-file flags of a parsed namespace, as the family's configure_from_args takes them."""
    return {name: getattr(ns, name, None) for name in COMPONENT_FILE_FLAGS}


def flux_options_from_args(values: Mapping[str, Any]) -> FluxOptions:
    """FluxOptions from a dict of flags, checked (one-line ConfigError)."""
    length = values.get("t5xxl_max_token_length")
    if length is not None and not (isinstance(length, int) and 1 <= length <= T5_MAX_TOKENS):
        raise ConfigError(f"--t5xxl_max_token_length: expected an integer from 1 to {T5_MAX_TOKENS} "
                          f"(T5-XXL's limit), got {length!r}")
    guidance = values.get("guidance_scale")
    guidance = 3.5 if guidance is None else float(guidance)
    if guidance < 0:
        raise ConfigError(f"--guidance_scale: expected a number >= 0, got {guidance}")
    return FluxOptions(guidance_scale=guidance, t5xxl_max_token_length=length,
                       apply_t5_attn_mask=bool(values.get("apply_t5_attn_mask")),
                       clip_l=values.get("clip_l"), t5xxl=values.get("t5xxl"), ae=values.get("ae"))
