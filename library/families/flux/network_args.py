"""FLUX.1's own networks.lora `--network_args` (those of sd-scripts' networks/lora_flux.py).

- per-type dims `img_attn_dim`, `img_mlp_dim`, `img_mod_dim`, `txt_*` (double
  blocks), `single_dim` (linear1 + linear2), `single_mod_dim` (modulation);
- `in_dims=[img,time,vector,guidance,txt]`: LoRAs on the layers outside the blocks;
- `train_blocks=all|single|double` and `train_double_block_indices` /
  `train_single_block_indices` ("0,3-5", "all", "none");
- `network_reg_dims` / `network_reg_lrs` (`regex=value,...`, first match wins);
- `train_t5xxl=True`: LoRAs on T5-XXL too (`lora_te3_`); `verbose=True`;
- `split_qkv=True`: q, k, v (and linear1's MLP input) each get their own LoRA, saved as one fused module of
  n times the rank with a block-diagonal `lora_up` (networks/lora_fused.py);
- `ggpo_sigma` / `ggpo_beta`: LoRA-GGPO (networks/ggpo.py), training only.

The order in which they decide a module's dim follows sd-scripts: `train_blocks`
drops a block kind outright; then a `network_reg_dims` match; then the per-type
dim (or the in_dims value), and a block left out by the index lists gets none.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import nn

from library.core.errors import ConfigError
from library.families.common.network_args import block_selection
from library.families.flux.lora_names import (
    OUTSIDE_BLOCKS,
    bfl_path,
    outside_block_name,
)
from networks.lora_rules import (
    RegexValues,
    parse_bool,
    parse_number,
    parse_regex_values,
)
from networks.lora_targets import LoraTarget
from library.families.common.network_args import dim_list

logger = logging.getLogger(__name__)

# Per-type dim argument -> the BFL layers (inside a block, first dotted part) it sets.
TYPE_DIMS: dict[str, tuple[str, ...]] = {
    "img_attn_dim": ("img_attn",), "img_mlp_dim": ("img_mlp",), "img_mod_dim": ("img_mod",),
    "txt_attn_dim": ("txt_attn",), "txt_mlp_dim": ("txt_mlp",), "txt_mod_dim": ("txt_mod",),
    "single_dim": ("linear1", "linear2"), "single_mod_dim": ("modulation",),
}
# The five in_dims values, in order, and the BFL layer groups outside the blocks they set.
IN_DIM_GROUPS = ("img_in", "time_in", "vector_in", "guidance_in", "txt_in")
TRAIN_BLOCKS = ("all", "single", "double")
KEYS = (*TYPE_DIMS, "in_dims", "train_blocks", "train_double_block_indices", "train_single_block_indices",
        "network_reg_dims", "network_reg_lrs", "train_t5xxl", "verbose", "split_qkv", "ggpo_sigma", "ggpo_beta")
# sd-scripts' split_qkv: the fused layers that train one LoRA per projection (q, k, v; linear1 also the MLP input).
_SPLIT_NAME = re.compile(r"^lora_unet_(double_blocks_\d+_(img|txt)_attn_qkv|single_blocks_\d+_linear1)$")

_BLOCK_NAME = re.compile(r"^lora_unet_(double|single)_blocks_(\d+)_")
_IN_NAME = re.compile(r"^lora_unet_(" + "|".join(IN_DIM_GROUPS) + r")(?:_|$)")
_LAYER_TYPE = {layer: arg for arg, layers in TYPE_DIMS.items() for layer in layers}


@dataclass
class FluxModuleRules:
    """The parsed FLUX.1 arguments; see networks/lora_rules.py ModuleRules for the questions they answer."""

    type_dims: dict[str, int] = field(default_factory=dict)  # only the per-type dims given
    in_dims: Optional[list[int]] = None
    train_blocks: str = "all"
    double_blocks: Optional[frozenset[int]] = None  # None: every block
    single_blocks: Optional[frozenset[int]] = None
    reg_dims: RegexValues = field(default_factory=RegexValues)
    reg_lrs: RegexValues = field(default_factory=RegexValues)
    train_t5xxl: bool = False
    verbose: bool = False
    split_qkv: bool = False
    ggpo: Optional[tuple[float, float]] = None  # (sigma, beta): LoRA-GGPO (networks/ggpo.py)

    def split(self, name: str) -> bool:
        """With split_qkv, every double block's img/txt `qkv` and every single block's `linear1`."""
        return self.split_qkv and _SPLIT_NAME.match(name) is not None

    def enables(self, key: str) -> bool:
        if key == "train_t5xxl":
            return self.train_t5xxl
        if key == "in_dims":
            return self.in_dims is not None and any(self.in_dims)
        return False

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        block = _BLOCK_NAME.match(name)
        if block and self.train_blocks not in ("all", block[1]):
            return 0
        hit = self.reg_dims.first_match(name)
        if hit is not None:
            return hit[1]
        group = _IN_NAME.match(name)
        if group:
            return self.in_dims[IN_DIM_GROUPS.index(group[1])] if self.in_dims else 0
        if not block:
            return default
        dim = self.type_dims.get(_LAYER_TYPE.get(_layer_type(name), ""), default)
        chosen = self.double_blocks if block[1] == "double" else self.single_blocks
        return 0 if dim and chosen is not None and int(block[2]) not in chosen else dim

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        return self.reg_lrs.first_match(name)


@dataclass(frozen=True)
class FluxNetworkArgs:
    """FLUX.1's networks.lora arguments for a transformer with this many double and single blocks."""

    num_double: int = 19
    num_single: int = 38
    keys: tuple[str, ...] = KEYS

    @classmethod
    def for_transformer(cls, transformer: nn.Module) -> "FluxNetworkArgs":
        config = transformer.config
        return cls(int(config.num_layers), int(config.num_single_layers))

    def parse(self, raw: Mapping[str, str]) -> FluxModuleRules:
        """Check and convert the FLUX.1 keys of `--network_args` (string values)."""
        rules = FluxModuleRules()
        rules.split_qkv = parse_bool("split_qkv", raw.get("split_qkv"))
        rules.ggpo = _ggpo(raw)
        for key in TYPE_DIMS:
            if raw.get(key) is not None:
                rules.type_dims[key] = parse_number(key, raw[key], int, "an integer >= 0 (0: no module)")
        if raw.get("in_dims") is not None:
            rules.in_dims = _in_dims(raw["in_dims"])
        train_blocks = str(raw.get("train_blocks") or "all").strip()
        if train_blocks not in TRAIN_BLOCKS:
            raise ConfigError(f"--network_args train_blocks: expected one of {', '.join(TRAIN_BLOCKS)}, "
                              f"got {train_blocks!r}")
        rules.train_blocks = train_blocks
        rules.double_blocks = block_selection("train_double_block_indices", raw, self.num_double)
        rules.single_blocks = block_selection("train_single_block_indices", raw, self.num_single)
        if raw.get("network_reg_dims") is not None:
            rules.reg_dims = parse_regex_values("network_reg_dims", raw["network_reg_dims"], int, "an integer >= 0")
        if raw.get("network_reg_lrs") is not None:
            rules.reg_lrs = parse_regex_values("network_reg_lrs", raw["network_reg_lrs"], float, "a number >= 0")
        rules.train_t5xxl = parse_bool("train_t5xxl", raw.get("train_t5xxl"))
        rules.verbose = parse_bool("verbose", raw.get("verbose"))
        return rules


# diffusers modules outside the blocks that in_dims targets: a bare Linear each (img_in, txt_in) and the
# embedders of time_text_embed (time_in, vector_in, guidance_in), found by class from the transformer root.
_BARE_LINEARS = ("img_in", "txt_in")
_EMBEDDER_CLASSES = ("TimestepEmbedding", "PixArtAlphaTextProjection")


def in_layer_targets(transformer: nn.Module, network_args: FluxNetworkArgs) -> list[LoraTarget]:
    """Optional targets (on with in_dims) for the layers outside the blocks that this transformer has.

    A schnell transformer has no guidance embedder, so it simply gets no guidance_in module.
    """
    targets = []
    for group in _BARE_LINEARS:
        path = OUTSIDE_BLOCKS[group]
        targets.append(LoraTarget("lora_unet", transformer.get_submodule(path), ("Linear",),
                                  rename=lambda _path, group=group: group, enabled_by="in_dims",
                                  network_args=network_args))
    targets.append(LoraTarget("lora_unet", transformer, _EMBEDDER_CLASSES, rename=_outside_name,
                              enabled_by="in_dims", network_args=network_args))
    return targets


def _outside_name(path: str) -> str:
    return outside_block_name(path) or path


def _layer_type(name: str) -> str:
    """`lora_unet_double_blocks_0_img_attn_qkv` -> `img_attn`; `..._single_blocks_3_linear1` -> `linear1`."""
    path = bfl_path(name[len("lora_unet_"):])
    return path.split(".")[2] if path else ""


def _in_dims(text: str) -> list[int]:
    """`[img,time,vector,guidance,txt]` (brackets optional) -> five dims >= 0."""
    return dim_list("in_dims", text, "[img,time,vector,guidance,txt]", len(IN_DIM_GROUPS))




def _ggpo(raw: Mapping[str, str]) -> Optional[tuple[float, float]]:
    """(sigma, beta) when both ggpo_sigma and ggpo_beta are given (finite numbers >= 0); None when neither."""
    given = [key for key in ("ggpo_sigma", "ggpo_beta") if raw.get(key) is not None]
    if not given:
        return None
    if len(given) == 1:
        other = "ggpo_beta" if given[0] == "ggpo_sigma" else "ggpo_sigma"
        raise ConfigError(f"--network_args {given[0]}: LoRA-GGPO needs {other} too (e.g. ggpo_sigma=0.03 "
                          f"ggpo_beta=0.01)")
    values = []
    for key in ("ggpo_sigma", "ggpo_beta"):
        value = parse_number(key, raw[key], float, "a finite number >= 0")
        if not math.isfinite(value):
            raise ConfigError(f"--network_args {key}: expected a finite number >= 0, got {raw[key].strip()!r}")
        values.append(value)
    return values[0], values[1]
