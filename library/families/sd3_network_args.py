"""SD3's own networks.lora `--network_args` (those of sd-scripts' networks/lora_sd3.py).

- per-type dims `context_attn_dim`, `context_mlp_dim`, `context_mod_dim`, `x_attn_dim`, `x_mlp_dim`,
  `x_mod_dim` (0: no module); as sd-scripts, the first type whose words are all in the module name
  wins (so `x_attn_dim` also sets SD3.5 medium's `attn2`);
- `train_block_indices` ("0,3-5", "all", "none"): joint blocks left out get no module;
- `train_t5xxl=True`: LoRAs on T5-XXL too (`lora_te3_`); `verbose=True`.

`emb_dims` (LoRAs outside the blocks) and `split_qkv` are refused with a one-line error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from library.core.errors import ConfigError
from library.families.flux_network_args import _block_selection
from networks.lora_rules import parse_bool, parse_number

TYPE_DIMS: dict[str, tuple[str, str]] = {
    "context_attn_dim": ("context_block", "attn"), "context_mlp_dim": ("context_block", "mlp"),
    "context_mod_dim": ("context_block", "adaLN_modulation"), "x_attn_dim": ("x_block", "attn"),
    "x_mlp_dim": ("x_block", "mlp"), "x_mod_dim": ("x_block", "adaLN_modulation"),
}
UNSUPPORTED = {
    "split_qkv": "networks.lora trains the fused qkv with one shared lora_down (the saved layout); drop split_qkv",
    "emb_dims": "LoRAs outside the joint blocks are not implemented for SD3 yet; drop emb_dims",
}
KEYS = (*TYPE_DIMS, "train_block_indices", "train_t5xxl", "verbose", *UNSUPPORTED)
_BLOCK_NAME = re.compile(r"^lora_unet_joint_blocks_(\d+)_")


@dataclass
class SD3ModuleRules:
    """The parsed SD3 arguments (networks/lora_rules.py ModuleRules)."""

    type_dims: dict[str, int] = field(default_factory=dict)
    blocks: Optional[frozenset[int]] = None  # None: every block
    train_t5xxl: bool = False
    verbose: bool = False

    def enables(self, key: str) -> bool:
        return key == "train_t5xxl" and self.train_t5xxl

    def dim(self, name: str, default: Optional[int]) -> Optional[int]:
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
        for key, why in UNSUPPORTED.items():
            if raw.get(key) is not None and (key != "split_qkv" or parse_bool(key, raw[key])):
                raise ConfigError(f"--network_args {key}: not supported: {why}")
        rules = SD3ModuleRules()
        for key in TYPE_DIMS:
            if raw.get(key) is not None:
                rules.type_dims[key] = parse_number(key, raw[key], int, "an integer >= 0 (0: no module)")
        rules.blocks = _block_selection("train_block_indices", raw, self.num_blocks)
        rules.train_t5xxl = parse_bool("train_t5xxl", raw.get("train_t5xxl"))
        rules.verbose = parse_bool("verbose", raw.get("verbose"))
        return rules
