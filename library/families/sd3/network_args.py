"""SD3's own networks.lora `--network_args` (those of sd-scripts' networks/lora_sd3.py).

- per-type dims `context_attn_dim`, `context_mlp_dim`, `context_mod_dim`, `x_attn_dim`, `x_mlp_dim`,
  `x_mod_dim` (0: no module); as sd-scripts, the first type whose words are all in the module name
  wins (so `x_attn_dim` also sets SD3.5 medium's `attn2`);
- `train_block_indices` ("0,3-5", "all", "none"): joint blocks left out get no module;
- `emb_dims=[context,t,x,y,final_mod,final_linear]`: LoRAs on the layers outside the joint blocks
  (`context_embedder`, `t_embedder.mlp.0/2`, the `x_embedder.proj` 2x2 conv, `y_embedder.mlp.0/2`,
  `final_layer.adaLN_modulation.1`, `final_layer.linear`) with those dims (0: none);
- `split_qkv=True`: each joint block's q, k and v get their own LoRA, saved as one fused `qkv` module of
  three times the rank with a block-diagonal `lora_up` (networks/lora_fused.py);
- `train_t5xxl=True`: LoRAs on T5-XXL too (`lora_te3_`); `verbose=True`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from torch import nn

from library.families.common.network_args import block_selection, dim_list
from library.families.sd3.lora_names import OUTSIDE_BLOCKS
from networks.lora_rules import parse_bool, parse_number
from networks.lora_targets import LoraTarget

TYPE_DIMS: dict[str, tuple[str, str]] = {
    "context_attn_dim": ("context_block", "attn"), "context_mlp_dim": ("context_block", "mlp"),
    "context_mod_dim": ("context_block", "adaLN_modulation"), "x_attn_dim": ("x_block", "attn"),
    "x_mlp_dim": ("x_block", "mlp"), "x_mod_dim": ("x_block", "adaLN_modulation"),
}
# The six emb_dims values, in order: the SAI paths (outside the joint blocks) each one sets.
EMB_DIM_GROUPS: tuple[tuple[str, ...], ...] = (
    ("context_embedder",), ("t_embedder.mlp.0", "t_embedder.mlp.2"), ("x_embedder.proj",),
    ("y_embedder.mlp.0", "y_embedder.mlp.2"), ("final_layer.adaLN_modulation.1",), ("final_layer.linear",))
EMB_DIM_OF = {"lora_unet_" + path.replace(".", "_"): i for i, paths in enumerate(EMB_DIM_GROUPS) for path in paths}
KEYS = (*TYPE_DIMS, "emb_dims", "split_qkv", "train_block_indices", "train_t5xxl", "verbose")
_BLOCK_NAME = re.compile(r"^lora_unet_joint_blocks_(\d+)_")


@dataclass
class SD3ModuleRules:
    """The parsed SD3 arguments (networks/lora_rules.py ModuleRules)."""

    type_dims: dict[str, int] = field(default_factory=dict)
    emb_dims: Optional[list[int]] = None
    split_qkv: bool = False
    blocks: Optional[frozenset[int]] = None  # None: every block
    train_t5xxl: bool = False
    verbose: bool = False

    def enables(self, key: str) -> bool:
        if key == "emb_dims":
            return self.emb_dims is not None and any(self.emb_dims)
        return key == "train_t5xxl" and self.train_t5xxl

    def split(self, name: str) -> bool:
        """sd-scripts' rule: with split_qkv, every joint-block module with `qkv` in its name."""
        return self.split_qkv and name.startswith("lora_unet_joint_blocks_") and "qkv" in name

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
        if name in EMB_DIM_OF:
            return self.emb_dims[EMB_DIM_OF[name]] if self.emb_dims else 0
        block = _BLOCK_NAME.match(name)
        if not block:
            return default
        dim = default
        for key, words in TYPE_DIMS.items():
            if key in self.type_dims and all(w in name for w in words):
                dim = self.type_dims[key]
                break
        return 0 if dim and self.blocks is not None and int(block[1]) not in self.blocks else dim

    def lr(self, name: str) -> Optional[tuple[int, float]]:
        return None


@dataclass(frozen=True)
class SD3NetworkArgs:
    """SD3's networks.lora arguments for a transformer with this many joint blocks."""

    num_blocks: int = 24
    keys: tuple[str, ...] = KEYS

    def parse(self, raw: Mapping[str, str]) -> SD3ModuleRules:
        rules = SD3ModuleRules()
        if raw.get("emb_dims") is not None:
            rules.emb_dims = dim_list("emb_dims", raw["emb_dims"], "[context,t,x,y,final_mod,final_linear]",
                                      len(EMB_DIM_GROUPS))
        rules.split_qkv = parse_bool("split_qkv", raw.get("split_qkv"))
        for key in TYPE_DIMS:
            if raw.get(key) is not None:
                rules.type_dims[key] = parse_number(key, raw[key], int, "an integer >= 0 (0: no module)")
        rules.blocks = block_selection("train_block_indices", raw, self.num_blocks)
        rules.train_t5xxl = parse_bool("train_t5xxl", raw.get("train_t5xxl"))
        rules.verbose = parse_bool("verbose", raw.get("verbose"))
        return rules


def emb_layer_targets(transformer: nn.Module, network_args: SD3NetworkArgs) -> list[LoraTarget]:
    """Optional targets (on with emb_dims) for the layers outside the joint blocks, named by their SAI paths as
    sd-scripts' lora_sd3.py names them (`lora_unet_x_embedder_proj` is diffusers' `pos_embed.proj`)."""
    targets = []
    for paths in EMB_DIM_GROUPS:
        for path in paths:
            module = transformer.get_submodule(OUTSIDE_BLOCKS[path])
            targets.append(LoraTarget("lora_unet", module, (type(module).__name__,), rename=lambda _p, path=path: path,
                                      enabled_by="emb_dims", network_args=network_args))
    return targets
