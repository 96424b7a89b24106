"""Kohya LoRA module names <-> diffusers/PEFT module paths, for every family, and which family a file is.

A kohya name (`lora_unet_<path>`, `lora_te1_<path>`, … with `.` turned into `_`)
uses the naming of the model sd-scripts trains on: SGM paths for the SDXL UNet,
BFL paths for Flux (one fused layer for q, k, v). A diffusers/PEFT file names
modules by diffusers paths under a part (`unet.`, `text_encoder.`,
`text_encoder_2.`, `transformer.`). The name tables live in each family's
`*_lora_names` module; this module picks the family and applies them, so that
library/families/lora_convert.py only does the tensor math.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from library.families.flux import lora_names as flux
from library.families.lumina import lora_names as lumina
from library.families.qwen_image import lora_names as qwen_image
from library.families.sd3 import lora_names as sd3
from library.families.sdxl import lora_names as sdxl
from library.families.zimage import lora_names as zimage
from library.families.common.ldm_layout import LayoutError

# Identifiers with underscores in diffusers / transformers / SGM module paths, so that a kohya
# name (every "." turned into "_") can be dotted again: the longest match wins.
_VOCAB = frozenset("""
down_blocks up_blocks mid_block transformer_blocks single_transformer_blocks proj_in proj_out to_q to_k to_v
to_out time_emb_proj conv_shortcut conv_in conv_out time_embedding linear_1 linear_2 add_embedding text_model
self_attn q_proj k_proj v_proj out_proj final_layer_norm ff_context norm1_context to_add_out add_q_proj add_k_proj
add_v_proj proj_mlp x_embedder context_embedder time_text_embed timestep_embedder guidance_embedder text_embedder
norm_out wi_0 wi_1 layer_norm1 layer_norm2 text_projection input_blocks middle_block output_blocks in_layers
out_layers emb_layers skip_connection time_embed label_emb o_proj gate_proj up_proj down_proj
""".split())
# SD 1.x/2.x: kohya paths are the diffusers paths themselves.
_SD_PREFIX = {"unet": "lora_unet", "text_encoder": "lora_te", "text_encoder_2": "lora_te2"}
# Kohya text-encoder prefix -> diffusers part, over all families (te1 is always the first encoder).
_TE_PARTS = {prefix: part for table in (_SD_PREFIX, sdxl.KOHYA_PREFIX, flux.KOHYA_PREFIX)
             for part, prefix in table.items() if part.startswith("text_encoder")}
KOHYA_PREFIXES = ("lora_unet", *sorted(_TE_PARTS))


@dataclass(frozen=True)
class KohyaModule:
    """One kohya LoRA module and the diffusers/PEFT modules it stands for."""

    name: str  # kohya module name, e.g. "lora_unet_double_blocks_0_img_attn_qkv"
    paths: tuple[str, ...]  # PEFT module paths with their part, in the fused layer's row order
    widths: tuple[int, ...] = (1,)  # relative row count of each path inside the fused layer
    swap_halves: bool = False  # the two row halves of `up` are in the other order in the diffusers model
    # SD3's context adaLN: its halves swap only in the pre-only (last) block, whose up has 2 · in_features rows
    swap_halves_if_two_chunks: bool = False
    # Grouped-query qkv (Lumina): q has as many rows as the layer's input, k and v share the rest equally
    query_rows_are_input: bool = False

    def split_dims(self, out_features: int, in_features: Optional[int] = None) -> list[int]:
        """Rows of each projection in a fused `up` with `out_features` rows (`in_features`: the layer's input
        width, needed for a grouped-query qkv)."""
        if self.query_rows_are_input:
            rest = (out_features - in_features) // 2
            return [in_features, rest, rest]
        unit = out_features // sum(self.widths)
        head = [unit * w for w in self.widths[:-1]]
        return head + [out_features - sum(head)]

    def fused_dims(self, rows: Sequence[Optional[int]], in_features: Optional[int] = None) -> list[int]:
        """Rows of each projection given those present (None for a missing one), the missing ones from the widths
        (a grouped-query qkv: q from `in_features`, k and v from each other)."""
        if self.query_rows_are_input:
            kv = rows[1] if rows[1] is not None else rows[2]
            if kv is None:
                raise ValueError(f"{self.name}: only q has a LoRA, so the width of k and v is unknown")
            return [in_features, kv, kv]
        unit = next(r // w for r, w in zip(rows, self.widths) if r is not None)
        return [r if r is not None else unit * w for r, w in zip(rows, self.widths)]


class UnmappedPathError(ValueError):
    """A PEFT module path that the detected family has no kohya name for."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def dotted(underscored: str) -> str:
    """A kohya module path back in dotted form, e.g. down_blocks_0_attentions_0_proj_in -> down_blocks.0.attentions.0.proj_in."""
    tokens = underscored.split("_")
    parts, i = [], 0
    while i < len(tokens):
        for j in range(min(len(tokens), i + 4), i + 1, -1):
            if "_".join(tokens[i:j]) in _VOCAB:
                parts.append("_".join(tokens[i:j]))
                i = j
                break
        else:
            parts.append(tokens[i])
            i += 1
    return ".".join(parts)


def peft_targets(kohya_name: str) -> Optional[KohyaModule]:
    """The PEFT modules of one kohya module name (any family: the names do not overlap); None for an unknown prefix."""
    head, _, rest = kohya_name.partition("_")[2].partition("_")
    prefix = "lora_" + head
    if prefix == "lora_unet":
        bfl = flux.bfl_path(rest)
        if bfl is not None:
            paths = flux.diffusers_paths(bfl)
            return KohyaModule(kohya_name, tuple(f"transformer.{p}" for p in paths), flux.fused_widths(bfl),
                               swap_halves=paths[0] in flux.SWAPPED_HALVES)
        # SGM paths become diffusers paths; SD 1.x/2.x paths already are.
        return KohyaModule(kohya_name, (f"unet.{sdxl.diffusers_module_path(dotted(rest))}",))
    if prefix in _TE_PARTS:
        return KohyaModule(kohya_name, (f"{_TE_PARTS[prefix]}.{dotted(rest)}",))
    return None


def is_sd3_file(kohya_names: Sequence[str]) -> bool:
    """True when kohya module names are an SD3 LoRA's (joint blocks; its lora_te3 is T5 = text_encoder_3)."""
    return any(sd3.is_sd3_kohya_name(n) for n in kohya_names)


def sd3_peft_targets(kohya_name: str) -> Optional[KohyaModule]:
    """The PEFT modules (StableDiffusion3Pipeline parts) of one SD3 kohya module name; None when unknown."""
    head, _, rest = kohya_name.partition("_")[2].partition("_")
    prefix = "lora_" + head
    if prefix == "lora_unet":
        path = sd3.sai_path(rest)
        if path is None:
            return None
        paths = sd3.diffusers_paths(path)
        return KohyaModule(kohya_name, tuple(f"transformer.{p}" for p in paths), (1,) * len(paths),
                           swap_halves=paths[0] == "norm_out.linear",
                           swap_halves_if_two_chunks=paths[0].endswith("norm1_context.linear"))
    part = {v: k for k, v in sd3.KOHYA_PREFIX.items()}.get(prefix)
    return None if part is None or part == "transformer" else KohyaModule(kohya_name, (f"{part}.{dotted(rest)}",))


def is_lumina_file(kohya_names: Sequence[str]) -> bool:
    """True when kohya module names are a Lumina LoRA's (joint / refiner blocks; its lora_te is Gemma-2)."""
    return any(lumina.is_lumina_kohya_name(n) for n in kohya_names)


def zimage_peft_targets(kohya_name: str) -> Optional[KohyaModule]:
    """The PEFT modules (ZImagePipeline parts) of one Z-Image kohya module name (Qwen3: `text_encoder.`); None when
    unknown."""
    head, _, rest = kohya_name.partition("_")[2].partition("_")
    if head == "te":
        return KohyaModule(kohya_name, (f"text_encoder.{dotted(rest)}",))
    paths = zimage.diffusers_paths(rest) if head == "unet" else None
    if paths is None:
        return None
    return KohyaModule(kohya_name, tuple(f"transformer.{p}" for p in paths), (1,) * len(paths))


_QWEN_IMAGE_BLOCK = re.compile(r"^lora_unet_transformer_blocks_\d+_(img_mod|txt_mod|img_mlp|txt_mlp|attn_add_[qkv]_proj|"
                               r"attn_to_add_out)")


def is_qwen_image_file(kohya_names: Sequence[str]) -> bool:
    """True when kohya module names are a Qwen-Image LoRA's (musubi-tuner's networks.lora_qwen_image: diffusers
    paths of QwenImageTransformer2DModel, which no other family's kohya names use)."""
    return any(_QWEN_IMAGE_BLOCK.match(n) for n in kohya_names)


def qwen_image_peft_targets(kohya_name: str) -> Optional[KohyaModule]:
    """The PEFT module (QwenImagePipeline's `transformer.`) of one Qwen-Image kohya name; None when unknown."""
    if not kohya_name.startswith(qwen_image.LORA_PREFIX):
        return None
    return KohyaModule(kohya_name, (f"transformer.{qwen_image.dotted(kohya_name[len(qwen_image.LORA_PREFIX):])}",))


def lumina_peft_targets(kohya_name: str) -> Optional[KohyaModule]:
    """The PEFT modules (Lumina2Pipeline parts) of one Lumina kohya module name; None when unknown."""
    head, _, rest = kohya_name.partition("_")[2].partition("_")
    if head == "te":
        return KohyaModule(kohya_name, (f"text_encoder.{dotted(rest)}",))
    original = lumina.original_path(rest) if head == "unet" else None
    if original is None:
        return None
    paths = lumina.diffusers_paths(original)
    return KohyaModule(kohya_name, tuple(f"transformer.{p}" for p in paths), (1,) * len(paths),
                       query_rows_are_input=len(paths) > 1)


def lumina_kohya_modules(peft_paths: Sequence[str]) -> list[KohyaModule]:
    """The kohya modules of a Lumina PEFT file's paths: q, k and v of one attention fused into its `attention_qkv`."""
    by_name: dict[str, KohyaModule] = {}
    for path in peft_paths:
        part, _, module = path.partition(".")
        if part == "text_encoder":
            by_name.setdefault(path, KohyaModule(f"lora_te_{module.replace('.', '_')}", (path,)))
            continue
        original = lumina.original_of(module) if part == "transformer" else None
        if original is None:
            raise UnmappedPathError(path, "not a Lumina DiT LoRA layer")
        name = "lora_unet_" + original.replace(".", "_")
        paths = lumina.diffusers_paths(original)
        by_name.setdefault(name, KohyaModule(name, tuple(f"transformer.{p}" for p in paths), (1,) * len(paths),
                                             query_rows_are_input=len(paths) > 1))
    return list(by_name.values())


FLUX_HIDDEN = 3072  # every FLUX.1 transformer's width; SD3's are 64 · heads (1536, 2432)


def is_sd3_peft(peft_paths: Sequence[str], transformer_width: Optional[int]) -> bool:
    """True when a PEFT file's module paths (and the input width of its transformer attention LoRAs) are an SD3
    LoRA's: a T5 part (`text_encoder_3`) or SD3.5's `attn2`, or transformer blocks without FLUX.1's single blocks
    at a width other than FLUX.1's. (Both name their joint blocks `transformer.transformer_blocks.N`.)"""
    if any(p.startswith("text_encoder_3.") or (p.startswith("transformer.") and ".attn2." in p) for p in peft_paths):
        return True
    if any(p.startswith("transformer.single_transformer_blocks.") for p in peft_paths):
        return False
    return transformer_width is not None and transformer_width != FLUX_HIDDEN


def sd3_kohya_modules(peft_paths: Sequence[str]) -> list[KohyaModule]:
    """The kohya modules of an SD3 PEFT file's paths: q, k, v of one attention fused into its SAI `qkv`."""
    by_name: dict[str, KohyaModule] = {}
    for path in peft_paths:
        part, _, module = path.partition(".")
        if part != "transformer":
            if part not in sd3.KOHYA_PREFIX:
                raise UnmappedPathError(path, "not an SD3 part")
            by_name.setdefault(path, KohyaModule(f"{sd3.KOHYA_PREFIX[part]}_{module.replace('.', '_')}", (path,)))
            continue
        sai_path = sd3.sai_module_path(module)
        paths = sd3.diffusers_paths(sai_path)
        if sai_path == module and module not in sd3.OUTSIDE_BLOCKS.values() or not paths:
            raise UnmappedPathError(path, "not an SD3 MMDiT LoRA layer")
        name = "lora_unet_" + sai_path.replace(".", "_")
        by_name.setdefault(name, KohyaModule(name, tuple(f"transformer.{p}" for p in paths), (1,) * len(paths),
                                             swap_halves=paths[0] == "norm_out.linear",
                                             swap_halves_if_two_chunks=paths[0].endswith("norm1_context.linear")))
    return list(by_name.values())


def kohya_modules(peft_paths: Sequence[str]) -> list[KohyaModule]:
    """The kohya modules for a PEFT file's module paths, named in the family the paths belong to.

    Flux projections of one fused BFL layer come back as one module. Raises
    UnmappedPathError for a path the family has no name for.
    """
    if flux.owns_peft_paths(peft_paths):
        return _flux_modules(peft_paths)
    if sdxl.owns_peft_paths(peft_paths):
        return [_plain(p, sdxl.KOHYA_PREFIX, _sgm_module_path) for p in peft_paths]
    return [_plain(p, _SD_PREFIX, lambda module: module) for p in peft_paths]


def _sgm_module_path(module: str) -> str:
    try:
        return sdxl.sgm_module_path(module)
    except LayoutError:  # not a UNet layer SGM renames: keep the path
        return module


def _plain(path: str, prefixes: dict[str, str], unet_path) -> KohyaModule:
    part, _, module = path.partition(".")
    module = unet_path(module) if part == "unet" else module
    return KohyaModule(f"{prefixes[part]}_{module.replace('.', '_')}", (path,))


def _flux_modules(peft_paths: Sequence[str]) -> list[KohyaModule]:
    present = set(peft_paths)
    fused: dict[str, list[str]] = {}
    for blocks in ("transformer.transformer_blocks.", "transformer.single_transformer_blocks."):
        for path in peft_paths:
            if path.startswith(blocks):
                for bfl in flux.block_layers(path[len("transformer."):]):
                    fused.setdefault(bfl, [f"transformer.{p}" for p in flux.diffusers_paths(bfl)])
    modules, used = [], set()
    for bfl, paths in fused.items():
        if any(p in present for p in paths):
            used.update(paths)
            modules.append(KohyaModule("lora_unet_" + bfl.replace(".", "_"), tuple(paths), flux.fused_widths(bfl)))
    for path in peft_paths:
        if path in used:
            continue
        part, _, module = path.partition(".")
        if part != "transformer":
            modules.append(_plain(path, flux.KOHYA_PREFIX, lambda m: m))
            continue
        bfl = flux.outside_block_name(module)
        if bfl is None:
            raise UnmappedPathError(path, "not a Flux module")
        modules.append(KohyaModule("lora_unet_" + bfl.replace(".", "_"), (path,),
                                   swap_halves=module in flux.SWAPPED_HALVES))
    return modules
