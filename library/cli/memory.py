"""Memory flags (sd-scripts names): --fp8_base, --fp8_base_unet, --blocks_to_swap, --cpu_offload_checkpointing."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

from library.cli.options import at_least, flag
from library.core.errors import ConfigError
from library.families import registered_families
from library.families.base import ModelFamily
from library.families.common.gguf_file import gguf_missing, is_gguf
from library.train.memory.checkpoint_policy import POLICIES as CHECKPOINT_POLICIES
from library.train.memory.quantize import CHOICES as PRECISION_CHOICES
from library.train.memory.quantize import NO_CHANGE, precision_unavailable
from library.train.settings import MemoryOptions
from library.train.speedups import SpeedOptions

logger = logging.getLogger(__name__)


@dataclass
class MemoryFlags:
    """The memory flags: every training script takes them; the family decides what it supports."""
    flag_group: ClassVar[str] = "memory"
    fp8_base: bool = flag(False, "store the base model's Linear/Conv2d weights as float8 (e4m3) and upcast them layer"
                                 " by layer; about half the weight memory of bf16")
    fp8_base_unet: bool = flag(False, "float8 for the U-Net / DiT only; the text encoders keep the training dtype "
                                      "(implies --fp8_base)")
    blocks_to_swap: Optional[int] = flag(None, "keep N transformer blocks in CPU memory and stream each to the GPU "
                                               "for its forward and backward (DiT families; FLUX.1: N//2 double and "
                                               "2*(N-N//2) single blocks)", range=at_least(1))
    cpu_offload_checkpointing: bool = flag(False, "with gradient checkpointing, keep each block's saved inputs in CPU"
                                                  " memory until the backward pass (DiT families; turns on "
                                                  "--gradient_checkpointing)")
    gradient_checkpointing_policy: str = flag(
        "full", "what a checkpointed block keeps for backward: full = only its inputs, all recomputed (sd-scripts' "
              "--gradient_checkpointing); attention = also its attention outputs; matmul = also its "
              "matrix-product and convolution outputs (recomputes only elementwise and norm ops). Not full: turns on "
              "--gradient_checkpointing (docs/memory.md)", choices=CHECKPOINT_POLICIES)
    base_model_precision: str = flag(NO_CHANGE, "store the frozen denoiser's Linear weights quantized (LoRA only): "
                                                "int8 / fp8 / int4 by optimum-quanto, int8 / fp8 by torchao, nf4 by "
                                                "bitsandbytes (docs/quantization.md)", choices=PRECISION_CHOICES)
    text_encoder_precision: str = flag(NO_CHANGE, "the same for the frozen text encoders", choices=PRECISION_CHOICES)
    split_mode: bool = flag(False, "deprecated sd-scripts FLUX.1 flag: as --blocks_to_swap 18 (ignored when "
                                   "--blocks_to_swap is given)")
    double_blocks_to_swap: Optional[int] = flag(None, "deprecated sd-scripts FLUX.1 flag: --blocks_to_swap gets N "
                                                      "(plus --single_blocks_to_swap // 2)", range=at_least(1))
    single_blocks_to_swap: Optional[int] = flag(None, "deprecated sd-scripts FLUX.1 flag: --blocks_to_swap gets N // 2 "
                                                      "(plus --double_blocks_to_swap)", range=at_least(1))


@dataclass
class SpeedFlags:
    """Speed-ups that are on by default (they change no result beyond float rounding; docs/performance.md)."""
    flag_group: ClassVar[str] = "speed"
    no_auto_text_cache: bool = flag(False, "encode the captions every step even when the text encoders are frozen "
                                           "and the captions fixed (by default each caption's outputs are kept in "
                                           "memory the first time it is met)")
    no_channels_last: bool = flag(False, "keep the denoiser's frozen convolution weights NCHW (by default they are "
                                         "stored channels_last, which the convolution kernels run faster)")
    no_fused_lora: bool = flag(False, "compute each LoRA'd Linear as org(x) + up(down(x)) * scale with three "
                                      "separate products (by default the update is fused with the frozen "
                                      "layer's product, merged into its weight in float32: the same sums, fewer "
                                      "passes)")


def speed_options_from_args(values: Mapping[str, Any]) -> SpeedOptions:
    return SpeedOptions(auto_text_cache=not values.get("no_auto_text_cache"),
                        channels_last=not values.get("no_channels_last"),
                        fused_lora=not values.get("no_fused_lora"))


def memory_options_from_args(values: Mapping[str, Any], family: Any = None, fine_tune: bool = False) -> MemoryOptions:
    """MemoryOptions from a dict of flags, checked against what `family` supports (one-line ConfigError).
    `fine_tune`: a full fine-tune's flags (which refuse a quantized base)."""
    # A family's own sd-scripts spelling of a shared flag counts as that flag (ModelFamily.flag_aliases:
    # HunyuanImage's --fp8_scaled is --fp8_base_unet here, without scales; Anima's --unsloth_offload_checkpointing)
    aliased = {flag: bool(values.get(flag)) for flag in ("fp8_base_unet", "cpu_offload_checkpointing")}
    for f in [family] if family is not None else registered_families():  # a family's flags come with its script
        for alias, flag in getattr(f, "flag_aliases", ()):
            aliased[flag] = aliased.get(flag, False) or bool(values.get(alias))
    fp8_unet = aliased["fp8_base_unet"]
    swap = blocks_to_swap_with_aliases(values)
    if swap is not None and (isinstance(swap, bool) or not isinstance(swap, int) or swap < 1):
        raise ConfigError(f"--blocks_to_swap: expected an integer >= 1, got {swap!r}")
    offload = aliased["cpu_offload_checkpointing"]
    name = getattr(family, "name", "this model family")
    if swap is not None and family is not None and not family_supports_block_swap(family):
        swapping = ", ".join(f.name for f in registered_families() if f.supports_block_swap())
        raise ConfigError(f"--blocks_to_swap: not supported for {name} (only DiT families stream their "
                          f"transformer blocks: {swapping}); drop the flag")
    if swap is not None and values.get("torch_compile"):
        raise ConfigError("--torch_compile with --blocks_to_swap: swapped blocks change device every step, so their "
                          "compiled code would be re-traced every step; drop one of them")
    if values.get("xformers") and values.get("flash_attn"):
        raise ConfigError("--xformers and --flash_attn: choose one attention backend")
    policy = values.get("gradient_checkpointing_policy") or "full"
    if policy not in CHECKPOINT_POLICIES:
        raise ConfigError(f"--gradient_checkpointing_policy: expected one of {', '.join(CHECKPOINT_POLICIES)}, "
                          f"got {policy!r}")
    if offload and policy != "full":
        raise ConfigError(f"--cpu_offload_checkpointing with --gradient_checkpointing_policy {policy}: the offloaded "
                          "checkpoint keeps only block inputs (full); drop one of them")
    precisions = check_precisions(values, fine_tune, fp8=bool(values.get("fp8_base")) or fp8_unet, swap=swap)
    return MemoryOptions(fp8_base=bool(values.get("fp8_base")) or fp8_unet, fp8_base_unet=fp8_unet,
                         blocks_to_swap=swap, cpu_offload_checkpointing=offload,
                         gradient_checkpointing_policy=policy,
                         xformers=bool(values.get("xformers")), flash_attn=bool(values.get("flash_attn")),
                         **precisions)


# Values whose quantized layers the block swapper cannot move, and why (the others: their weight is one tensor
# subclass whose .to() moves codes and scales together).
SWAP_REFUSED = {"nf4-bnb": "bitsandbytes keeps a 4-bit weight's quantization state (absmax, code) beside the "
                           "weight, and the swapper moves only the weight; use int4-quanto, or drop one of them"}


def check_precisions(values: Mapping[str, Any], fine_tune: bool, fp8: bool, swap: Optional[int]) -> dict[str, str]:
    """--base_model_precision / --text_encoder_precision, checked before anything loads (one-line ConfigError);
    also what a GGUF base file (already quantized) rules out."""
    check_gguf_base(values, fine_tune, fp8)
    out = {}
    for name in ("base_model_precision", "text_encoder_precision"):
        value = values.get(name) or NO_CHANGE
        out[name] = value
        if value == NO_CHANGE:
            continue
        why = precision_unavailable(value)
        if why:
            raise ConfigError(f"--{name} {value}: {why}")
        if fine_tune:
            raise ConfigError(f"--{name} {value}: a full fine-tune trains these weights, which cannot be quantized; "
                              "use a LoRA script (*_train_network.py) or drop the flag")
        if fp8:
            raise ConfigError(f"--{name} with --fp8_base: choose one way to store the base (fp8-quanto or "
                              "fp8-torchao is float8 by a library)")
        if swap is not None and name == "base_model_precision" and value in SWAP_REFUSED:
            raise ConfigError(f"--{name} {value} with --blocks_to_swap: {SWAP_REFUSED[value]}")
    return out


def check_gguf_base(values: Mapping[str, Any], fine_tune: bool, fp8: bool) -> None:
    """A GGUF --pretrained_model_name_or_path holds its weights quantized already: LoRA only, no second storage."""
    path = values.get("pretrained_model_name_or_path")
    if not isinstance(path, str) or not os.path.isfile(path) or not is_gguf(path):
        return
    label = f"--pretrained_model_name_or_path {path}"
    missing = gguf_missing()
    if missing:
        raise ConfigError(f"{label}: {missing}")
    if fine_tune:
        raise ConfigError(f"{label}: a GGUF file holds quantized weights, which a full fine-tune cannot train; use "
                          "a LoRA script (*_train_network.py) or the .safetensors model")
    value = values.get("base_model_precision") or NO_CHANGE
    if value != NO_CHANGE:
        raise ConfigError(f"--base_model_precision {value}: {path} is a GGUF file, already quantized; drop the flag")
    if fp8:
        raise ConfigError(f"--fp8_base with {path}: a GGUF file is already quantized; drop --fp8_base")
    if values.get("base_weights"):
        raise ConfigError(f"--base_weights with {path}: a GGUF file's weights stay quantized, nothing can be merged "
                          "into them; merge into the .safetensors model first, or drop --base_weights")


def blocks_to_swap_with_aliases(values: Mapping[str, Any]) -> Any:
    """--blocks_to_swap, or what sd-scripts' deprecated FLUX.1 flags map to (flux_train_network.py --split_mode: 18;
    flux_train.py --double_blocks_to_swap D --single_blocks_to_swap S: D + S // 2), with one warning."""
    swap = values.get("blocks_to_swap")
    double, single = values.get("double_blocks_to_swap"), values.get("single_blocks_to_swap")
    if double is not None or single is not None:
        mapped = (double or 0) + (single or 0) // 2
        if swap is not None:
            raise ConfigError("--double_blocks_to_swap / --single_blocks_to_swap: deprecated forms of --blocks_to_swap;"
                              " give only --blocks_to_swap")
        logger.warning("--double_blocks_to_swap / --single_blocks_to_swap are deprecated (as in sd-scripts): using "
                       "--blocks_to_swap %d", mapped)
        swap = mapped or None
    if values.get("split_mode"):
        if swap is None:
            logger.warning("--split_mode is deprecated (as in sd-scripts): using --blocks_to_swap 18")
            swap = 18
        else:
            logger.warning("--split_mode is deprecated and ignored: --blocks_to_swap %d is given", swap)
    return swap


def gradient_checkpointing_wanted(opts: MemoryOptions, given: bool) -> bool:
    """--gradient_checkpointing as given, or turned on (with a warning, as sd-scripts) by
    --cpu_offload_checkpointing, or by a --gradient_checkpointing_policy other than full, which work through it."""
    if opts.cpu_offload_checkpointing and not given:
        logger.warning("--cpu_offload_checkpointing: turning on --gradient_checkpointing, which it works through")
        return True
    if opts.gradient_checkpointing_policy != "full" and not given:
        logger.warning("--gradient_checkpointing_policy %s: turning on --gradient_checkpointing, which it works "
                       "through", opts.gradient_checkpointing_policy)
        return True
    return given


def family_supports_block_swap(family: Any) -> bool:
    """Whether the family overrides ModelFamily.swappable_blocks (the DiT families)."""
    method = getattr(type(family), "swappable_blocks", None)
    return method is not None and method is not ModelFamily.swappable_blocks
