"""Text-encoder output cache flags (--cache_text_encoder_outputs, ...), added by families that support it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Union

from library.cli.options import add_flags, at_least, flag, flag_specs
from library.train.settings import TextCacheOptions


@dataclass
class TextCacheFlags:
    """The sd-scripts text-encoder cache flags (a family that supports the cache adds them)."""
    flag_group: ClassVar[str] = "text encoder output cache"
    cache_text_encoder_outputs: bool = flag(False, "encode every caption once before training and keep the outputs in"
                                                   " memory (not with caption shuffle/dropout/warmup/wildcards or "
                                                   "text-encoder training)")
    cache_text_encoder_outputs_to_disk: bool = flag(False, "also write them beside each image as "
                                                           "<stem>_te_outputs.npz (implies "
                                                           "--cache_text_encoder_outputs)")
    text_encoder_batch_size: Optional[int] = flag(None, "captions per text-encoder batch while caching (default: "
                                                        "--vae_batch_size)", range=at_least(1))


def text_cache_options_from_args(ns: Union[argparse.Namespace, Mapping[str, Any]]) -> TextCacheOptions:
    """TextCacheOptions from a namespace or a dict of flag values; absent flags mean off."""
    values = ns if isinstance(ns, Mapping) else vars(ns)
    to_disk = bool(values.get("cache_text_encoder_outputs_to_disk") or False)
    t5_only = bool(values.get("use_t5xxl_cache_only") or False)  # sd3_train.py: implies the cache, as sd-scripts
    return TextCacheOptions(enabled=bool(values.get("cache_text_encoder_outputs") or False) or to_disk or t5_only,
                            to_disk=to_disk, batch_size=max(1, int(values.get("text_encoder_batch_size")
                                                    or values.get("vae_batch_size") or 1)))
