"""Convert LoRA state dicts between the kohya, diffusers/PEFT and ai-toolkit layouts, by key pattern.

- kohya: `lora_unet_<path>.lora_down.weight` / `.lora_up.weight` / `.alpha`, the module
  path with `.` replaced by `_` (SDXL UNet paths in SGM naming, Flux in BFL naming
  with fused qkv / linear1).
- diffusers (PEFT): `unet.` / `text_encoder.` / `text_encoder_2.` / `transformer.` +
  the diffusers module path + `.lora_A.weight` / `.lora_B.weight`; alpha is baked
  into the weights (split between A and B exactly as diffusers' own kohya
  converter does, so Flux output matches it key for key and value for value).
- ai-toolkit (Flux): the diffusers layout with `transformer.` keys; fused kohya
  layers are split per projection.

Going back to kohya, split projections are fused again: one shared `lora_down`
when the inputs share A, otherwise stacked downs and a block-diagonal up; alpha
becomes the rank (scale 1). ΔW is preserved in every direction.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from library.core.tensors import unshared
from library.families.anima import lora_comfy as anima_lora
from library.families.flux2 import lora_names as flux2_lora
from library.families.hunyuan_image import layout as hunyuan_layout
from library.families.lora_layouts import (
    KOHYA_PREFIXES,
    UnmappedPathError,
    dotted,
    is_lumina_file,
    is_qwen_image_file,
    is_sd3_file,
    is_sd3_peft,
    kohya_modules,
    lumina_kohya_modules,
    lumina_peft_targets,
    peft_targets,
    qwen_image_peft_targets,
    sd3_kohya_modules,
    sd3_peft_targets,
    zimage_peft_targets,
)
from library.families.zimage import lora_names as zimage_names
from library.families.lumina.lora_names import owns_peft_paths as is_lumina_peft
from networks.lora_files import (
    KOHYA_SUFFIXES,
    LoraFile,
    LoraModule,
    UnsupportedLoraError,
    check_not_lycoris,
    group_modules,
    read_state_dict,
)

LAYOUTS = ("kohya", "diffusers", "ai-toolkit", "comfy")  # comfy: the names ComfyUI maps (Anima, HunyuanImage, Chroma, Lumina)
PEFT_SUFFIXES = {"lora_A.weight": "down", "lora_B.weight": "up", "alpha": "alpha"}
_DIFFUSERS_PARTS = ("unet", "text_encoder", "text_encoder_2", "text_encoder_3", "transformer")


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    # The model the kohya name refers to orders the two output halves the other way round.
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def detect_layout(state: Mapping[str, torch.Tensor], source: str) -> str:
    """"kohya" or "diffusers" (ai-toolkit Flux files share the diffusers layout); one-line error otherwise."""
    check_not_lycoris(state, source)
    if flux2_lora.is_flux2_lora(state):  # FLUX.2 (before Anima's: both use diffusion_model.): kohya, comfy, PEFT
        return flux2_lora.layout_name(state)
    if anima_lora.is_comfy(state):
        return "comfy"
    for key in state:
        name, _, suffix = key.partition(".")
        if name.startswith("lora_") and suffix in KOHYA_SUFFIXES or key.startswith(COMFY_GEMMA2_PREFIX):
            return "kohya"  # ComfyUI's Gemma-2 names (Lumina's --to comfy) are read back as kohya
        if name in _DIFFUSERS_PARTS and key.endswith((".lora_A.weight", ".lora_B.weight")):
            return "diffusers"
    raise UnsupportedLoraError(f"{source}: unexpected key {next(iter(state))!r}; expected a kohya (lora_unet_…"
                               f".lora_down.weight) or diffusers/PEFT (unet.….lora_A.weight) LoRA")


def scale_split(scale: float) -> tuple[float, float]:
    """(scale_down, scale_up) with product `scale`: diffusers' kohya converter rule."""
    down, up = scale, 1.0
    while down * 2 < up:
        down *= 2
        up /= 2
    return down, up


def _split_fused(m: LoraModule, dims: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) per projection of a fused module, alpha already baked in (diffusers' rule incl. sparse ups)."""
    sd, su = scale_split(m.scale)
    down, up = m.down * sd, m.up * su
    n = len(dims)
    if m.rank % n == 0:
        r = m.rank // n
        starts = [sum(dims[:j]) for j in range(n)]
        sparse = all(torch.all(up[starts[j]:starts[j] + dims[j], k * r:(k + 1) * r] == 0)
                     for j in range(n) for k in range(n) if j != k)
        if sparse:
            return [(down[j * r:(j + 1) * r], up[starts[j]:starts[j] + dims[j], j * r:(j + 1) * r].contiguous())
                    for j in range(n)]
    return [(down, b) for b in torch.split(up, dims, dim=0)]


# tools/convert_lora.py --family: the ss_base_model_version each family's files carry (sd-scripts' lumina2; ours and
# musubi-tuner's zimage), for a file whose metadata does not say which of the two NextDiT families it is
FAMILY_VERSIONS = {"lumina": "lumina2", "zimage": "zimage"}


def nextdit_family(state: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> str:
    """"zimage" or "lumina" for a LoRA with NextDiT block names (both families have them): the metadata
    (ss_base_model_version zimage / lumina2, modelspec.architecture z-image... / lumina...), else a layer only one
    has (Z-Image's adaLN_modulation_0, Lumina's adaLN_modulation_1), else Lumina (tools/convert_lora.py --family
    zimage says otherwise)."""
    metadata = metadata or {}
    version = metadata.get("ss_base_model_version", "")
    architecture = metadata.get("modelspec.architecture", "").lower()
    if version == "zimage" or architecture.startswith("z-image"):
        return "zimage"
    if version == "lumina2" or architecture.startswith("lumina"):
        return "lumina"
    layers = {zimage_names.block_layer(k.partition(".")[0]) for k in state}
    return "zimage" if zimage_names.ZIMAGE_ONLY_LAYER in layers and zimage_names.LUMINA_ONLY_LAYER not in layers \
        else "lumina"


def to_diffusers(state: Mapping[str, torch.Tensor], source: str,
                 metadata: Optional[Mapping[str, str]] = None) -> dict[str, torch.Tensor]:
    """Kohya state dict to the diffusers/PEFT layout, alpha baked in (Flux: fused layers split); `metadata` tells a
    Z-Image file from a Lumina one (nextdit_family)."""
    modules = group_modules(state, source)
    nextdit = nextdit_family(state, metadata) if is_lumina_file(list(modules)) else None
    # Lumina's Gemma-2 and Z-Image's Qwen3 names (lora_te_layers_N_) look like Anima's Qwen3 ones
    if nextdit is None and anima_lora.is_anima(state):
        raise UnsupportedLoraError(f"{source}: an Anima LoRA; diffusers reads Anima LoRAs only in ComfyUI's "
                                   f"diffusion_model.* layout: use --to comfy")
    out: dict[str, torch.Tensor] = {}
    if nextdit is not None:
        lookup = zimage_peft_targets if nextdit == "zimage" else lumina_peft_targets
    elif is_qwen_image_file(list(modules)):
        lookup = qwen_image_peft_targets  # QwenImagePipeline.load_lora_weights: `transformer.` keys only
    else:
        lookup = sd3_peft_targets if is_sd3_file(list(modules)) else peft_targets
    for name, m in modules.items():
        target = lookup(name)
        if target is None:
            prefix = "lora_" + name.partition("_")[2].partition("_")[0]
            raise UnsupportedLoraError(f"{source}: {name}: unexpected module prefix {prefix!r}; expected "
                                       f"{', '.join(KOHYA_PREFIXES[:-1])} or {KOHYA_PREFIXES[-1]}")
        if len(target.paths) > 1:
            for path, (a, b) in zip(target.paths, _split_fused(m, target.split_dims(m.out_features, m.in_flat))):
                out[f"{path}.lora_A.weight"], out[f"{path}.lora_B.weight"] = a, b
            continue
        sd, su = scale_split(m.scale)
        swap = target.swap_halves or (target.swap_halves_if_two_chunks and m.up.shape[0] == 2 * m.down.shape[1])
        up = _swap_halves(m.up * su) if swap else m.up * su
        out[f"{target.paths[0]}.lora_A.weight"], out[f"{target.paths[0]}.lora_B.weight"] = m.down * sd, up
    return unshared(out)  # split projections share one A (or slice one): each key gets its own storage


def to_ai_toolkit(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Kohya Flux LoRA to ai-toolkit's layout (the diffusers keys); refuses a non-Flux file."""
    converted = to_diffusers(state, source)
    if not any(k.startswith("transformer.") for k in converted):
        raise UnsupportedLoraError(f"{source}: the ai-toolkit layout is for Flux LoRAs; this file has no Flux "
                                   f"transformer modules (first key {next(iter(state))!r})")
    return converted


def _peft_groups(state: Mapping[str, torch.Tensor], source: str) -> dict[str, dict[str, torch.Tensor]]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        for suffix, role in PEFT_SUFFIXES.items():
            if key.endswith("." + suffix) and key.split(".")[0] in _DIFFUSERS_PARTS:
                groups.setdefault(key[:-len(suffix) - 1], {})[role] = value
                break
        else:
            raise UnsupportedLoraError(f"{source}: unexpected key {key!r}; expected <unet|text_encoder|text_encoder_2|"
                                       f"text_encoder_3|transformer>.<module>.lora_A.weight / .lora_B.weight")
    for path, g in groups.items():
        if "down" not in g or "up" not in g:
            raise UnsupportedLoraError(f"{source}: {path}.{'lora_B' if 'down' in g else 'lora_A'}.weight is missing")
    return groups


def _fuse(parts: list[Optional[dict[str, torch.Tensor]]], dims: Optional[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One kohya (down, up) for split projections: a shared A stays shared, otherwise block-diagonal."""
    present = [p for p in parts if p is not None]
    ups = [p["up"] * _peft_scale(p) for p in present]
    if dims is None:
        dims = [ups[0].shape[0]] * len(parts)
    if all(torch.equal(p["down"], present[0]["down"]) for p in present):
        rank = present[0]["down"].shape[0]
        blocks = iter(ups)
        up = torch.cat([next(blocks) if p is not None else ups[0].new_zeros(d, rank) for p, d in zip(parts, dims)])
        return present[0]["down"], up
    down = torch.cat([p["down"] for p in present])
    up = down.new_zeros(sum(dims), down.shape[0])
    row, col, blocks = 0, 0, iter(ups)
    for p, d in zip(parts, dims):
        if p is not None:
            b = next(blocks)
            up[row:row + d, col:col + b.shape[1]] = b
            col += b.shape[1]
        row += d
    return down, up


def _peft_scale(group: Mapping[str, torch.Tensor]) -> float:
    return float(group["alpha"]) / group["down"].shape[0] if "alpha" in group else 1.0


def to_kohya(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Diffusers/PEFT (or ai-toolkit) state dict to kohya keys; alpha = rank (the scale is in the weights)."""
    groups = _peft_groups(state, source)
    width = next((g["down"].shape[1] for p, g in groups.items() if p.startswith("transformer.transformer_blocks.")
                  and p.endswith((".attn.to_q", ".attn.to_k", ".attn.to_v"))), None)
    try:
        paths = list(groups)
        modules = lumina_kohya_modules(paths) if is_lumina_peft(paths) else \
            sd3_kohya_modules(paths) if is_sd3_peft(paths, width) else kohya_modules(paths)
    except UnmappedPathError as e:
        raise UnsupportedLoraError(f"{source}: unexpected key {e.path}.lora_A.weight: {e.reason}") from None
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        parts = [groups.get(p) for p in module.paths]
        if len(parts) == 1:
            down, up = parts[0]["down"], parts[0]["up"] * _peft_scale(parts[0])
            swap = module.swap_halves or (module.swap_halves_if_two_chunks and up.shape[0] == 2 * down.shape[1])
            up = _swap_halves(up) if swap else up
        else:
            try:
                dims = module.fused_dims([p["up"].shape[0] if p is not None else None for p in parts],
                                         next(p["down"].shape[1] for p in parts if p is not None))
            except ValueError as e:
                raise UnsupportedLoraError(f"{source}: {e}") from None
            down, up = _fuse(parts, dims)
        out.update(_kohya_module(module.name, down, up))
    return out


def _kohya_module(name: str, down: torch.Tensor, up: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{name}.lora_down.weight": down.contiguous(), f"{name}.lora_up.weight": up.contiguous(),
            f"{name}.alpha": torch.tensor(float(down.shape[0]), dtype=down.dtype)}


# Chroma's T5 in kohya names: sd-scripts' lora_flux.py (and we) write it as FLUX.1's third encoder, lora_te3_;
# ComfyUI's key map (comfy/lora.py, model_lora_keys_clip) numbers a T5 that has no CLIP-L / CLIP-G beside it
# as the first: lora_te1_encoder_block_N_... . A T5 module name is never a CLIP one (text_model_encoder_layers_)
# nor HunyuanDiT's BERT (lora_te1_encoder_layer_N_...).
_T5_KOHYA, _T5_COMFY_ALONE = "lora_te3_encoder_block_", "lora_te1_encoder_block_"


def is_chroma_lora(state: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> bool:
    """Whether a kohya Flux-layout LoRA is Chroma's: its metadata says so (ss_base_model_version, as sd-scripts
    writes it), or, without metadata, it has T5 modules but no CLIP-L and no FLUX.1 modulation layers."""
    version = (metadata or {}).get("ss_base_model_version")
    if version:
        return version == "chroma"
    names = {k.partition(".")[0] for k in state}
    return (any(n.startswith(_T5_KOHYA) for n in names)
            and not any(n.endswith(("_mod_lin", "_modulation_lin")) or n.startswith("lora_te1_") for n in names))


def chroma_to_comfy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A kohya Chroma LoRA in the names ComfyUI maps onto Chroma: T5 lora_te3_ -> lora_te1_, the DiT unchanged."""
    return {(_T5_COMFY_ALONE + k[len(_T5_KOHYA):] if k.startswith(_T5_KOHYA) else k): v for k, v in state.items()}


# Lumina's Gemma-2 in kohya names (lora_te_layers_N_...): ComfyUI's key map has kohya names for CLIP, T5 and
# HunyuanDiT's BERT only, but maps every text-encoder weight by its generic name, `text_encoders.` + its state-dict
# key; Lumina's encoder is `gemma2_2b` (comfy/text_encoders/lumina2.py), a Llama-style `transformer.model`.
COMFY_GEMMA2_PREFIX = "text_encoders.gemma2_2b.transformer.model."
_GEMMA2_KOHYA = "lora_te_"


def is_lumina_lora(state: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> bool:
    """Whether a kohya LoRA is Lumina 2's: its metadata says so (ss_base_model_version lumina2, sd-scripts' value)
    or its DiT names are NextDiT's (a Gemma-2-only file without metadata reads as Anima's Qwen3: the same names)."""
    version = (metadata or {}).get("ss_base_model_version")
    if version == "lumina2":
        return True
    return is_lumina_file([k.partition(".")[0] for k in state]) and nextdit_family(state, metadata) == "lumina"


def lumina_to_comfy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A kohya Lumina LoRA in names ComfyUI maps: Gemma-2 `lora_te_<path>` -> `text_encoders.gemma2_2b.transformer.
    model.<dotted path>` (lora_down / lora_up / alpha kept), the DiT's kohya names unchanged (ComfyUI reads them)."""
    out = {}
    for key, value in state.items():
        name, _, suffix = key.partition(".")
        if name.startswith(_GEMMA2_KOHYA):
            key = f"{COMFY_GEMMA2_PREFIX}{dotted(name[len(_GEMMA2_KOHYA):])}.{suffix}"
        out[key] = value
    return out


def _comfy_text_encoder_names_to_kohya(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's names for Chroma's lone T5 (lora_te1_encoder_block_...: never CLIP-L's) and Lumina's Gemma-2
    (text_encoders.gemma2_2b.transformer.model.<path>) back to ours."""
    out = {}
    for key, value in state.items():
        if key.startswith(_T5_COMFY_ALONE):
            key = _T5_KOHYA + key[len(_T5_COMFY_ALONE):]
        elif key.startswith(COMFY_GEMMA2_PREFIX):
            rest = key[len(COMFY_GEMMA2_PREFIX):]
            suffix = next((x for x in KOHYA_SUFFIXES if rest.endswith("." + x)), None)
            if suffix is not None:  # anything else stays as it is and is named by the kohya reader
                key = f"{_GEMMA2_KOHYA}{rest[:-len(suffix) - 1].replace('.', '_')}.{suffix}"
        out[key] = value
    return out


def convert(state: Mapping[str, torch.Tensor], to: str, source: str,
            metadata: Optional[Mapping[str, str]] = None) -> dict[str, torch.Tensor]:
    """Convert `state` (layout detected) to `to`: "kohya", "diffusers", "ai-toolkit" or "comfy" (Anima,
    HunyuanImage, Chroma, Lumina); `metadata` (the file's) tells Chroma from FLUX.1 and a Gemma-2-only Lumina file
    from Anima."""
    if to not in LAYOUTS:
        raise UnsupportedLoraError(f"--to: expected one of {', '.join(LAYOUTS)}, got {to!r}")
    if flux2_lora.is_flux2_lora(state, metadata):  # before FLUX.1's: the same BFL block names
        return _convert_flux2(state, to, source)
    kohya = _as_kohya(state, detect_layout(state, source), source)
    if to == "kohya":
        return kohya
    if to == "comfy":
        if hunyuan_layout.is_kohya_lora(k.partition(".")[0] for k in kohya):
            return hunyuan_layout.comfy_lora_state(kohya)
        if is_lumina_lora(kohya, metadata):  # before Anima's: Gemma-2's names look like Qwen3's
            return lumina_to_comfy(kohya)
        if is_lumina_file([k.partition(".")[0] for k in kohya]):  # Z-Image (nextdit_family): its DiT's kohya names
            return kohya  # are the original module paths, which ComfyUI maps as they are; Qwen3's stay lora_te_
        if not anima_lora.is_anima(kohya):
            if is_chroma_lora(kohya, metadata):
                return chroma_to_comfy(kohya)
            raise UnsupportedLoraError(f"{source}: the comfy layout is for Anima LoRAs (lora_unet_blocks_N_…, "
                                       f"lora_te_layers_N_…), HunyuanImage LoRAs (lora_unet_double_blocks_N_"
                                       f"img_mlp_fc1, …), Chroma LoRAs (ss_base_model_version chroma) and Lumina LoRAs "
                                       f"(lora_unet_layers_N_attention_qkv, …); this file is none of them (first key "
                                       f"{next(iter(kohya))!r}); SD, SDXL, FLUX.1 and SD3 files load in ComfyUI as "
                                       f"they are")
        return anima_lora.to_comfy(kohya)
    return to_ai_toolkit(kohya, source) if to == "ai-toolkit" else to_diffusers(kohya, source, metadata)


def _convert_flux2(state: Mapping[str, torch.Tensor], to: str, source: str) -> dict[str, torch.Tensor]:
    """A FLUX.2 LoRA (kohya / musubi-tuner, ai-toolkit, ComfyUI or diffusers names) in the `to` layout
    (library/families/flux2/lora_names.py)."""
    try:
        kohya = flux2_lora.to_kohya_lora(state)
        if to == "kohya":
            return kohya
        if to == "diffusers":
            return flux2_lora.kohya_to_diffusers(kohya)
        return flux2_lora.kohya_to_bfl_peft(kohya, *(("lora_down.weight", "lora_up.weight", True)
                                                     if to == "comfy" else ()))
    except ValueError as e:
        raise UnsupportedLoraError(f"{source}: FLUX.2 LoRA: {e}") from None


def _as_kohya(state: Mapping[str, torch.Tensor], layout: str, source: str) -> dict[str, torch.Tensor]:
    if flux2_lora.is_flux2_lora(state):
        try:
            return flux2_lora.to_kohya_lora(state)
        except ValueError as e:
            raise UnsupportedLoraError(f"{source}: FLUX.2 LoRA: {e}") from None
    if layout == "kohya":
        return _comfy_text_encoder_names_to_kohya(state)
    if layout == "comfy":
        try:
            return anima_lora.from_comfy(state)
        except ValueError as e:
            raise UnsupportedLoraError(f"{source}: {e}") from None
    return to_kohya(state, source)


def load_lora_file(path: str) -> LoraFile:
    """Load a LoRA in kohya, diffusers/PEFT or ai-toolkit layout as kohya modules."""
    state, metadata = read_state_dict(path)
    if not state:
        raise UnsupportedLoraError(f"{path}: the file holds no tensors")
    layout = detect_layout(state, path)
    state = _as_kohya(state, layout, path)
    dtype = next(v.dtype for k, v in state.items() if not k.endswith(".alpha"))
    return LoraFile(path, group_modules(state, path), metadata, dtype, layout)

