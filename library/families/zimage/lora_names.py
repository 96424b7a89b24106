"""Z-Image's kohya LoRA names (the original module paths, `lora_unet_layers_0_attention_qkv`, as ComfyUI and
musubi-tuner write them) -> diffusers' ZImageTransformer2DModel paths, for tools/convert_lora.py --to diffusers.

The block names are Lumina 2's (both are NextDiT): only the metadata (`ss_base_model_version` zimage / lumina2,
`modelspec.architecture`) or a layer only one of them has tells the two apart: Z-Image's block modulation is one
Linear, `adaLN_modulation.0`; Lumina's is `adaLN_modulation.1` (after a SiLU).
"""

from __future__ import annotations

import re
from typing import Optional

_KOHYA_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)_(\d+)_(\w+)$")
# original module inside a block (underscored) -> diffusers paths, in the fused layer's row order
BLOCK_LINEARS = {
    "attention_qkv": ("attention.to_q", "attention.to_k", "attention.to_v"),
    "attention_out": ("attention.to_out.0",),
    "feed_forward_w1": ("feed_forward.w1",), "feed_forward_w2": ("feed_forward.w2",),
    "feed_forward_w3": ("feed_forward.w3",),
    "adaLN_modulation_0": ("adaLN_modulation.0",),
}
OUTSIDE_LINEARS = {
    "x_embedder": "all_x_embedder.2-1", "final_layer_linear": "all_final_layer.2-1.linear",
    "final_layer_adaLN_modulation_1": "all_final_layer.2-1.adaLN_modulation.1",
    "t_embedder_mlp_0": "t_embedder.mlp.0", "t_embedder_mlp_2": "t_embedder.mlp.2", "cap_embedder_1": "cap_embedder.1",
}
ZIMAGE_ONLY_LAYER = "adaLN_modulation_0"  # a block's modulation Linear (Lumina's is adaLN_modulation_1)
LUMINA_ONLY_LAYER = "adaLN_modulation_1"


def diffusers_paths(kohya_rest: str) -> Optional[tuple[str, ...]]:
    """The diffusers paths of a kohya name without `lora_unet_` (`layers_0_attention_qkv` -> the three of
    `layers.0.attention.to_q/k/v`); None when it names no Z-Image LoRA layer."""
    m = _KOHYA_BLOCK.match(kohya_rest)
    if m:
        inner = BLOCK_LINEARS.get(m[3])
        return None if inner is None else tuple(f"{m[1]}.{m[2]}.{p}" for p in inner)
    path = OUTSIDE_LINEARS.get(kohya_rest)
    return None if path is None else (path,)


def block_layer(kohya_name: str) -> Optional[str]:
    """The layer of a `lora_unet_` block name (`attention_qkv`, `adaLN_modulation_0`, ...), else None."""
    m = _KOHYA_BLOCK.match(kohya_name[len("lora_unet_"):]) if kohya_name.startswith("lora_unet_") else None
    return m[3] if m else None
