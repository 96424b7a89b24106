"""The `--network_args` of networks.lora, parsed and checked, and the SD UNet block map.

All values arrive as strings ("conv_dim=8"); a bad one raises ConfigError naming
the argument. Block-wise values follow sd-scripts: 25 blocks for SD 1.x/2.x
(IN00-IN11, MID, OUT00-OUT11), block learning-rate weights as 12 down values,
1 mid value and 12 up values (or a preset).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from library.errors import ConfigError

NUM_HALF_BLOCKS = 12  # IN00-IN11 and OUT00-OUT11
NUM_BLOCKS = NUM_HALF_BLOCKS * 2 + 1  # + MID
MID_BLOCK = NUM_HALF_BLOCKS

KNOWN_ARGS = (
    "conv_dim", "conv_alpha", "rank_dropout", "module_dropout",
    "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas",
    "down_lr_weight", "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold",
    "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio",
)
LR_WEIGHT_PRESETS = ("cosine", "sine", "linear", "reverse_linear", "zeros")

_UPDOWN = re.compile(r"_(up|down)_blocks_(\d+)_(resnets|attentions|upsamplers|downsamplers)_(\d+)_")


def sd_unet_block_index(lora_name: str) -> int:
    """Block (0-24) of an SD 1.x/2.x UNet LoRA name; -1 when it belongs to no block.

    Each diffusers down/up block holds three SGM blocks: resnet/attention j is
    block 3*i+j, and the down/up sampler closes the block at 3*i+2. IN00 is
    conv_in, which never gets a LoRA.
    """
    m = _UPDOWN.search(lora_name)
    if m:
        side, i, kind, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
        idx = 3 * i + (2 if kind in ("upsamplers", "downsamplers") else j)
        return 1 + idx if side == "down" else MID_BLOCK + 1 + idx
    if "_mid_block_" in lora_name:
        return MID_BLOCK
    return -1


@dataclass
class LoraNetworkArgs:
    """Typed `--network_args` of networks.lora plus the network's base dim/alpha."""

    network_dim: int = 4
    network_alpha: float = 1.0
    conv_dim: Optional[int] = None
    conv_alpha: Optional[float] = None
    rank_dropout: Optional[float] = None
    module_dropout: Optional[float] = None
    # per block (25 values); None when block-wise dims are off
    block_dims: Optional[list[int]] = None
    block_alphas: Optional[list[float]] = None
    conv_block_dims: Optional[list[int]] = None
    conv_block_alphas: Optional[list[float]] = None
    # block learning-rate weights; None when off
    down_lr_weight: Optional[list[float]] = None
    mid_lr_weight: Optional[float] = None
    up_lr_weight: Optional[list[float]] = None
    loraplus_lr_ratio: Optional[float] = None
    loraplus_unet_lr_ratio: Optional[float] = None
    loraplus_text_encoder_lr_ratio: Optional[float] = None

    @property
    def block_lr(self) -> bool:
        return self.down_lr_weight is not None or self.mid_lr_weight is not None or self.up_lr_weight is not None

    def lr_weight(self, block_idx: int) -> float:
        """Learning-rate weight of a UNet block (1.0 outside any block or when unset)."""
        if block_idx < 0:
            return 1.0
        if block_idx < MID_BLOCK:
            return self.down_lr_weight[block_idx] if self.down_lr_weight is not None else 1.0
        if block_idx == MID_BLOCK:
            return self.mid_lr_weight if self.mid_lr_weight is not None else 1.0
        return self.up_lr_weight[block_idx - MID_BLOCK - 1] if self.up_lr_weight is not None else 1.0


def _number(name: str, value: Any, cast: Callable[[str], Any], what: str) -> Any:
    try:
        return cast(str(value).strip())
    except ValueError:
        raise ConfigError(f"--network_args {name}: expected {what}, got {str(value)!r}") from None


def _optional(kwargs: Mapping[str, Any], name: str, cast: Callable[[str], Any], what: str) -> Any:
    value = kwargs.get(name)
    return None if value is None else _number(name, value, cast, what)


def _probability(kwargs: Mapping[str, Any], name: str) -> Optional[float]:
    p = _optional(kwargs, name, float, "a number in [0, 1)")
    if p is not None and not 0.0 <= p < 1.0:
        raise ConfigError(f"--network_args {name}: expected a number in [0, 1), got {p}")
    return p


def _block_list(kwargs: Mapping[str, Any], name: str, cast: Callable[[str], Any], what: str) -> Optional[list]:
    value = kwargs.get(name)
    if value is None:
        return None
    items = str(value).split(",")
    if len(items) != NUM_BLOCKS:
        raise ConfigError(f"--network_args {name}: expected {NUM_BLOCKS} comma-separated {what} "
                          f"(IN00-IN11, MID, OUT00-OUT11), got {len(items)}")
    return [_number(name, s, cast, what) for s in items]


def _lr_weights(name: str, value: Any) -> list[float]:
    """12 block lr weights from "a,b,c" (empty item = 0, padded with 1) or a preset[+base]."""
    text = str(value).strip()
    preset, _, base_text = text.partition("+")
    if preset in LR_WEIGHT_PRESETS:
        base = _number(name, base_text, float, "a number after '+'") if base_text else 0.0
        n = NUM_HALF_BLOCKS
        ramp = {
            "cosine": [math.sin(math.pi * (i / (n - 1)) / 2) for i in reversed(range(n))],
            "sine": [math.sin(math.pi * (i / (n - 1)) / 2) for i in range(n)],
            "linear": [i / (n - 1) for i in range(n)],
            "reverse_linear": [i / (n - 1) for i in reversed(range(n))],
            "zeros": [0.0] * n,
        }[preset]
        return [w + base for w in ramp]
    what = f"up to {NUM_HALF_BLOCKS} comma-separated numbers or one of {', '.join(LR_WEIGHT_PRESETS)}[+base]"
    weights = [_number(name, s, float, what) if s.strip() else 0.0 for s in text.split(",")]
    if len(weights) > NUM_HALF_BLOCKS:
        raise ConfigError(f"--network_args {name}: expected {what}, got {len(weights)} values")
    return weights + [1.0] * (NUM_HALF_BLOCKS - len(weights))


def parse_network_args(kwargs: Mapping[str, Any], network_dim: Optional[int] = None,
                       network_alpha: Optional[float] = None) -> LoraNetworkArgs:
    """Check and convert the `--network_args` strings of networks.lora."""
    unknown = [k for k in kwargs if k not in KNOWN_ARGS]
    if unknown:
        raise ConfigError(f"--network_args {unknown[0]}: unknown argument for networks.lora; "
                          f"expected one of {', '.join(KNOWN_ARGS)}")
    a = LoraNetworkArgs(network_dim=4 if network_dim is None else int(network_dim),
                        network_alpha=1.0 if network_alpha is None else float(network_alpha))
    a.conv_dim = _optional(kwargs, "conv_dim", int, "an integer")
    a.conv_alpha = _optional(kwargs, "conv_alpha", float, "a number")
    if a.conv_dim is not None and a.conv_alpha is None:
        a.conv_alpha = 1.0
    a.rank_dropout = _probability(kwargs, "rank_dropout")
    a.module_dropout = _probability(kwargs, "module_dropout")
    for key in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        setattr(a, key, _optional(kwargs, key, float, "a number"))

    threshold = _optional(kwargs, "block_lr_zero_threshold", float, "a number") or 0.0
    if kwargs.get("down_lr_weight") is not None:
        a.down_lr_weight = [w if w > threshold else 0.0 for w in _lr_weights("down_lr_weight", kwargs["down_lr_weight"])]
    if kwargs.get("up_lr_weight") is not None:
        a.up_lr_weight = [w if w > threshold else 0.0 for w in _lr_weights("up_lr_weight", kwargs["up_lr_weight"])]
    mid = _optional(kwargs, "mid_lr_weight", float, "a number")
    if mid is not None:
        a.mid_lr_weight = mid if mid > threshold else 0.0

    _parse_block_dims(kwargs, a)
    return a


def _parse_block_dims(kwargs: Mapping[str, Any], a: LoraNetworkArgs) -> None:
    """Fill the per-block dims when any block-wise argument is given (as sd-scripts).

    Unlike sd-scripts, conv_block_dims alone also enables block-wise dims instead
    of being silently ignored.
    """
    block_dims = _block_list(kwargs, "block_dims", int, "integers")
    conv_block_dims = _block_list(kwargs, "conv_block_dims", int, "integers")
    if block_dims is None and conv_block_dims is None and not a.block_lr:
        return
    a.block_dims = block_dims or [a.network_dim] * NUM_BLOCKS
    a.block_alphas = _block_list(kwargs, "block_alphas", float, "numbers") or [a.network_alpha] * NUM_BLOCKS
    if conv_block_dims is not None:
        a.conv_block_dims = conv_block_dims
        conv_alpha = a.conv_alpha if a.conv_alpha is not None else 1.0
        a.conv_block_alphas = _block_list(kwargs, "conv_block_alphas", float, "numbers") or [conv_alpha] * NUM_BLOCKS
    elif a.conv_dim is not None:
        a.conv_block_dims = [a.conv_dim] * NUM_BLOCKS
        a.conv_block_alphas = [a.conv_alpha] * NUM_BLOCKS
    # A block whose learning-rate weight is 0 would never train: do not create its modules.
    for idx in range(NUM_BLOCKS):
        if a.block_lr and a.lr_weight(idx) == 0:
            a.block_dims[idx] = 0
            if a.conv_block_dims is not None:
                a.conv_block_dims[idx] = 0
