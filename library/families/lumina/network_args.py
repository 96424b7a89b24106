"""Lumina's own networks.lora `--network_args` (those of sd-scripts' networks/lora_lumina.py).

- per-type dims `attn_dim`, `mlp_dim`, `mod_dim`, `refiner_dim` (0: no module) for the DiT's modules; as
  sd-scripts, the first type whose word is in the module name wins, in that order (`attention`, `mlp`,
  `modulation`, `refiner`: so a refiner block's attention takes `attn_dim` when it is given; `mlp` names no
  NextDiT module, whose MLP is `feed_forward`, so `mlp_dim` changes nothing, exactly as in sd-scripts);
- `train_blocks`: all (default), transformer (`layers_` only), noise_refiner, context_refiner, or refiners (both);
  DiT modules outside the choice get none (the final layer only with all);
- `embedder_dims=[x,t,cap]`: LoRAs on the embedders (`x_embedder`, `t_embedder.mlp.0/2`, `cap_embedder.1`) with
  those dims; as sd-scripts, train_blocks does not filter them but the type dims still apply (`mlp_dim` sets
  `t_embedder_mlp_*`), and a 0 leaves one out;
- `split_qkv=True`: each block's q, k and v (grouped-query: k and v narrower) get their own LoRA, saved as one
  fused `attention_qkv` of three times the rank with a block-diagonal `lora_up` (networks/lora_fused.py);
- `verbose=True`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import nn

from library.core.errors import ConfigError
from library.families.common.network_args import dim_list
from library.families.lumina.layout import OUTSIDE_MODULES
from networks.lora_rules import parse_bool, parse_number
from networks.lora_targets import LoraTarget

TYPE_DIMS = (("attn_dim", "attention"), ("mlp_dim", "mlp"), ("mod_dim", "modulation"), ("refiner_dim", "refiner"))
TRAIN_BLOCKS = {"all": None, "transformer": ("layers_",), "noise_refiner": ("noise_refiner",),
                "context_refiner": ("context_refiner",), "refiners": ("noise_refiner", "context_refiner")}
# The three embedder_dims values, in order: the original (NextDiT) paths of the Linears each one sets.
EMBEDDER_GROUPS: tuple[tuple[str, ...], ...] = (("x_embedder",), ("t_embedder.mlp.0", "t_embedder.mlp.2"),
                                                ("cap_embedder.1",))
EMBEDDER_OF = {"lora_unet_" + path.replace(".", "_"): i for i, paths in enumerate(EMBEDDER_GROUPS) for path in paths}
KEYS = (*(k for k, _ in TYPE_DIMS), "embedder_dims", "split_qkv", "train_blocks", "verbose")
UNET = "lora_unet_"


@dataclass
class LuminaModuleRules:
    """The parsed Lumina arguments (networks/lora_rules.py ModuleRules)."""

    type_dims: dict[str, int] = field(default_factory=dict)
    embedder_dims: Optional[list[int]] = None
    split_qkv: bool = False
    filters: Optional[tuple[str, ...]] = None  # None: every DiT module
    verbose: bool = False

    def enables(self, key: str) -> bool:
        # as sd-scripts: given at all (even [0,0,0]), the embedders are considered (a type dim may still set them)
        return key == "embedder_dims" and self.embedder_dims is not None

    def split(self, name: str) -> bool:
        """sd-scripts' rule (its state_dict merge): with split_qkv, every DiT module with `qkv` in its name."""
        return self.split_qkv and name.startswith(UNET) and "qkv" in name

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        if not name.startswith(UNET):
            return default
        embedder = EMBEDDER_OF.get(name)
        if embedder is not None:
            default = self.embedder_dims[embedder] if self.embedder_dims else 0
        dim = default
        for key, word in TYPE_DIMS:
            if key in self.type_dims and word in name:
                dim = self.type_dims[key]
                break
        if embedder is None and self.filters is not None and not any(f in name for f in self.filters):
            return 0
        return dim

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        return None


@dataclass(frozen=True)
class LuminaNetworkArgs:
    """Lumina's networks.lora arguments."""

    keys: tuple[str, ...] = KEYS

    def parse(self, raw: Mapping[str, str]) -> LuminaModuleRules:
        rules = LuminaModuleRules()
        if raw.get("embedder_dims") is not None:
            rules.embedder_dims = dim_list("embedder_dims", raw["embedder_dims"], "[x,t,cap]", len(EMBEDDER_GROUPS))
        rules.split_qkv = parse_bool("split_qkv", raw.get("split_qkv"))
        for key, _ in TYPE_DIMS:
            if raw.get(key) is not None:
                rules.type_dims[key] = parse_number(key, raw[key], int, "an integer >= 0 (0: no module)")
        choice = raw.get("train_blocks")
        if choice is not None:
            if choice not in TRAIN_BLOCKS:
                raise ConfigError(f"--network_args train_blocks: expected one of {', '.join(TRAIN_BLOCKS)}, "
                                  f"got {choice!r}")
            rules.filters = TRAIN_BLOCKS[choice]
        rules.verbose = parse_bool("verbose", raw.get("verbose"))
        return rules


_DIFFUSERS_PATH = {original: path for path, original in OUTSIDE_MODULES.items()}


def embedder_targets(transformer: nn.Module, network_args: LuminaNetworkArgs) -> list[LoraTarget]:
    """Optional targets (on with embedder_dims) for the embedders' Linears, named by their original NextDiT paths as
    sd-scripts' lora_lumina.py names them (`lora_unet_cap_embedder_1` is diffusers'
    `time_caption_embed.caption_embedder.1`)."""
    return [LoraTarget("lora_unet", transformer.get_submodule(_DIFFUSERS_PATH[path]), ("Linear",),
                       rename=lambda _p, path=path: path, enabled_by="embedder_dims", network_args=network_args)
            for paths in EMBEDDER_GROUPS for path in paths]
