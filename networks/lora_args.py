"""The `--network_args` of networks.lora, parsed and checked, and the UNet block layouts.

All values arrive as strings ("conv_dim=8"); a bad one raises ConfigError naming
the argument. Block-wise values follow sd-scripts, in the block layout the model
family gives (`BlockLayout`): SD 1.x/2.x has 25 blocks (IN00-IN11, MID,
OUT00-OUT11) and learning-rate weights as 12 down, 1 mid and 12 up values (or a
preset); SDXL has 23 blocks and 9 / 3 / 9 weights (library/families/sdxl/lora_names.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from library.core.errors import ConfigError

KNOWN_ARGS = (
    "conv_dim", "conv_alpha", "rank_dropout", "module_dropout",
    "block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas",
    "down_lr_weight", "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold",
    "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio",
)
LR_WEIGHT_PRESETS = ("cosine", "sine", "linear", "reverse_linear", "zeros")


@dataclass(frozen=True)
class BlockLayout:
    """How a UNet's LoRA modules fall into blocks, for block_dims / block_alphas / conv_block_* and block lr weights.

    `index_of(lora_name)` is a module's block (0 .. num_blocks-1), -1 for none.
    `down_lr_weight` covers the blocks of `down` in order, `mid_lr_weight` those
    of `mid`, `up_lr_weight` those of `up`; a block in none of them (SDXL's
    embeddings and out) always has weight 1. Calling the layout is `index_of`.
    """

    num_blocks: int
    down: range
    mid: range
    up: range
    index_of: Callable[[str], int]
    names: str = ""  # the blocks in order, for error messages ("IN00-IN11, MID, OUT00-OUT11")

    def __call__(self, lora_name: str) -> int:
        return self.index_of(lora_name)


_UPDOWN = re.compile(r"_(up|down)_blocks_(\d+)_(resnets|attentions|upsamplers|downsamplers)_(\d+)_")
_SD_HALF = 12  # IN00-IN11 and OUT00-OUT11


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
        return 1 + idx if side == "down" else _SD_HALF + 1 + idx
    if "_mid_block_" in lora_name:
        return _SD_HALF
    return -1


# sd-scripts' lora.py uses this layout for any model it does not know as SDXL.
SD_BLOCK_LAYOUT = BlockLayout(
    num_blocks=2 * _SD_HALF + 1, down=range(0, _SD_HALF), mid=range(_SD_HALF, _SD_HALF + 1),
    up=range(_SD_HALF + 1, 2 * _SD_HALF + 1), index_of=sd_unet_block_index, names="IN00-IN11, MID, OUT00-OUT11")


@dataclass
class LoraNetworkArgs:
    """Typed `--network_args` of networks.lora plus the network's base dim/alpha."""

    network_dim: int = 4
    network_alpha: float = 1.0
    conv_dim: Optional[int] = None
    conv_alpha: Optional[float] = None
    rank_dropout: Optional[float] = None
    module_dropout: Optional[float] = None
    # one value per block of the layout; None when block-wise dims are off
    block_dims: Optional[list[int]] = None
    block_alphas: Optional[list[float]] = None
    conv_block_dims: Optional[list[int]] = None
    conv_block_alphas: Optional[list[float]] = None
    # block learning-rate weights as given (padded, thresholded); None when not given
    down_lr_weight: Optional[list[float]] = None
    mid_lr_weight: Optional[list[float]] = None
    up_lr_weight: Optional[list[float]] = None
    # the same weights spread over all blocks of the layout; None when block lr is off
    block_lr_weights: Optional[list[float]] = None
    loraplus_lr_ratio: Optional[float] = None
    loraplus_unet_lr_ratio: Optional[float] = None
    loraplus_text_encoder_lr_ratio: Optional[float] = None

    @property
    def block_lr(self) -> bool:
        return self.block_lr_weights is not None

    def lr_weight(self, block_idx: int) -> float:
        """Learning-rate weight of a UNet block (1.0 outside any block or when unset)."""
        if block_idx < 0 or self.block_lr_weights is None:
            return 1.0
        return self.block_lr_weights[block_idx]


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


def _block_list(kwargs: Mapping[str, Any], name: str, cast: Callable[[str], Any], what: str,
                layout: BlockLayout) -> Optional[list]:
    value = kwargs.get(name)
    if value is None:
        return None
    items = str(value).split(",")
    if len(items) != layout.num_blocks:
        blocks = f" ({layout.names})" if layout.names else ""
        raise ConfigError(f"--network_args {name}: expected {layout.num_blocks} comma-separated {what} "
                          f"for this model{blocks}, got {len(items)}")
    return [_number(name, s, cast, what) for s in items]


def _preset_ramp(preset: str, n: int) -> list[float]:
    """sd-scripts' named weight curves over n blocks (shallow to deep)."""
    steps = max(n - 1, 1)
    return {
        "cosine": [math.sin(math.pi * (i / steps) / 2) for i in reversed(range(n))],
        "sine": [math.sin(math.pi * (i / steps) / 2) for i in range(n)],
        "linear": [i / steps for i in range(n)],
        "reverse_linear": [i / steps for i in reversed(range(n))],
        "zeros": [0.0] * n,
    }[preset]


def _lr_weights(name: str, value: Any, n: int, presets: bool) -> list[float]:
    """n block lr weights from "a,b,c" (empty item = 0, padded with 1) or, where allowed, a preset[+base]."""
    text = str(value).strip()
    preset, _, base_text = text.partition("+")
    if presets and preset in LR_WEIGHT_PRESETS:
        base = _number(name, base_text, float, "a number after '+'") if base_text else 0.0
        return [w + base for w in _preset_ramp(preset, n)]
    what = f"up to {n} comma-separated numbers for this model"
    if presets:
        what += f" or one of {', '.join(LR_WEIGHT_PRESETS)}[+base]"
    weights = [_number(name, s, float, what) if s.strip() else 0.0 for s in text.split(",")]
    if len(weights) > n:
        raise ConfigError(f"--network_args {name}: expected {what}, got {len(weights)} values")
    return weights + [1.0] * (n - len(weights))


def _parse_block_lr(kwargs: Mapping[str, Any], a: LoraNetworkArgs, layout: BlockLayout) -> None:
    """down/mid/up_lr_weight, zeroed at or below block_lr_zero_threshold, spread over the layout's blocks."""
    threshold = _optional(kwargs, "block_lr_zero_threshold", float, "a number") or 0.0
    parts = (("down_lr_weight", layout.down, True), ("mid_lr_weight", layout.mid, False),
             ("up_lr_weight", layout.up, True))
    for key, blocks, presets in parts:
        if kwargs.get(key) is not None:
            weights = _lr_weights(key, kwargs[key], len(blocks), presets)
            setattr(a, key, [w if w > threshold else 0.0 for w in weights])
    if a.down_lr_weight is None and a.mid_lr_weight is None and a.up_lr_weight is None:
        return
    flat = [1.0] * layout.num_blocks
    for key, blocks, _ in parts:
        for idx, w in zip(blocks, getattr(a, key) or []):
            flat[idx] = w
    a.block_lr_weights = flat


def parse_network_args(kwargs: Mapping[str, Any], network_dim: Optional[int] = None,
                       network_alpha: Optional[float] = None,
                       layout: BlockLayout = SD_BLOCK_LAYOUT, family_keys: tuple[str, ...] = ()) -> LoraNetworkArgs:
    """Check and convert the generic `--network_args` strings of networks.lora; block values follow `layout`.

    `family_keys` are the model family's own arguments (networks/lora_rules.py): accepted
    here, parsed by the family.
    """
    known = KNOWN_ARGS + tuple(family_keys)
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise ConfigError(f"--network_args {unknown[0]}: unknown argument for networks.lora with this model; "
                          f"expected one of {', '.join(known)}")
    kwargs = {k: v for k, v in kwargs.items() if k not in family_keys}
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
    _parse_block_lr(kwargs, a, layout)
    _parse_block_dims(kwargs, a, layout)
    return a


def _parse_block_dims(kwargs: Mapping[str, Any], a: LoraNetworkArgs, layout: BlockLayout) -> None:
    """Fill the per-block dims when any block-wise argument is given (as sd-scripts).

    Unlike sd-scripts, conv_block_dims alone also enables block-wise dims instead
    of being silently ignored.
    """
    n = layout.num_blocks
    block_dims = _block_list(kwargs, "block_dims", int, "integers", layout)
    conv_block_dims = _block_list(kwargs, "conv_block_dims", int, "integers", layout)
    block_alphas = _block_list(kwargs, "block_alphas", float, "numbers", layout)
    conv_block_alphas = _block_list(kwargs, "conv_block_alphas", float, "numbers", layout)
    if block_dims is None and conv_block_dims is None and not a.block_lr:
        return
    a.block_dims = block_dims or [a.network_dim] * n
    a.block_alphas = block_alphas or [a.network_alpha] * n
    if conv_block_dims is not None:
        a.conv_block_dims = conv_block_dims
        conv_alpha = a.conv_alpha if a.conv_alpha is not None else 1.0
        a.conv_block_alphas = conv_block_alphas or [conv_alpha] * n
    elif a.conv_dim is not None:
        a.conv_block_dims = [a.conv_dim] * n
        a.conv_block_alphas = [a.conv_alpha] * n
    # A block whose learning-rate weight is 0 would never train: do not create its modules.
    for idx in range(n):
        if a.lr_weight(idx) == 0:
            a.block_dims[idx] = 0
            if a.conv_block_dims is not None:
                a.conv_block_dims[idx] = 0


# sd-scripts' SDXL LoRA block layout: a fact of the kohya key format (SGM module names), so it lives here.
SDXL_NUM_BLOCKS = 23
_UNET_PREFIX = "lora_unet_"


def sdxl_unet_block_index(lora_name: str) -> int:
    """Block (0-22) of an SDXL UNet LoRA name in sd-scripts' 23-block layout; -1 for none."""
    if not lora_name.startswith(_UNET_PREFIX):
        return -1
    name = lora_name[len(_UNET_PREFIX):]
    if name.startswith(("time_embed_", "label_emb_")):
        return 0
    for start, base in (("input_blocks_", 1), ("middle_block_", 10), ("output_blocks_", 13)):
        if name.startswith(start):
            return base + int(name[len(start):].split("_")[0])
    if name.startswith("out_"):
        return SDXL_NUM_BLOCKS - 1
    return -1


def sdxl_block_layout() -> BlockLayout:
    """sd-scripts' SDXL block layout for networks.lora: 23 block_dims; 9 down, 3 mid, 9 up lr weights."""
    return BlockLayout(num_blocks=SDXL_NUM_BLOCKS, down=range(1, 10), mid=range(10, 13), up=range(13, 22),
                       index_of=sdxl_unet_block_index, names="emb, IN00-IN08, MID0-MID2, OUT00-OUT08, out")

