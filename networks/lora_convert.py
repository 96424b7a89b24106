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

import re
from typing import Mapping, Optional

import torch

from networks.lora_files import KOHYA_SUFFIXES, LoraModule, UnsupportedLoraError, check_not_lycoris, group_modules

LAYOUTS = ("kohya", "diffusers", "ai-toolkit")
PEFT_SUFFIXES = {"lora_A.weight": "down", "lora_B.weight": "up", "alpha": "alpha"}
# Identifiers with underscores in diffusers / transformers / SGM module paths, so that a kohya
# name (every "." turned into "_") can be dotted again: the longest match wins.
_VOCAB = frozenset("""
down_blocks up_blocks mid_block transformer_blocks single_transformer_blocks proj_in proj_out to_q to_k to_v
to_out time_emb_proj conv_shortcut conv_in conv_out time_embedding linear_1 linear_2 add_embedding text_model
self_attn q_proj k_proj v_proj out_proj final_layer_norm ff_context norm1_context to_add_out add_q_proj add_k_proj
add_v_proj proj_mlp x_embedder context_embedder time_text_embed timestep_embedder guidance_embedder text_embedder
norm_out wi_0 wi_1 layer_norm1 layer_norm2 text_projection input_blocks middle_block output_blocks in_layers
out_layers emb_layers skip_connection time_embed label_emb
""".split())
_TE_PREFIXES = {"lora_te": "text_encoder", "lora_te1": "text_encoder", "lora_te2": "text_encoder_2",
                "lora_te3": "text_encoder_2"}
_DIFFUSERS_PARTS = ("unet", "text_encoder", "text_encoder_2", "transformer")

# --- Flux: kohya (BFL) names <-> diffusers paths -------------------------------------
_FLUX_DOUBLE = {
    "img_attn_proj": ["attn.to_out.0"], "img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "img_mlp_0": ["ff.net.0.proj"], "img_mlp_2": ["ff.net.2"], "img_mod_lin": ["norm1.linear"],
    "txt_attn_proj": ["attn.to_add_out"], "txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "txt_mlp_0": ["ff_context.net.0.proj"], "txt_mlp_2": ["ff_context.net.2"], "txt_mod_lin": ["norm1_context.linear"],
}
_FLUX_SINGLE = {"linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"], "linear2": ["proj_out"],
                "modulation_lin": ["norm.linear"]}
_FLUX_OTHER = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer_linear": "proj_out", "final_layer_adaLN_modulation_1": "norm_out.linear",
}
_FLUX_BLOCK = re.compile(r"^(double|single)_blocks_(\d+)_(\w+)$")


def _flux_targets(rest: str) -> Optional[list[str]]:
    """Diffusers paths (inside `transformer`) of a Flux kohya module name without `lora_unet_`."""
    m = _FLUX_BLOCK.match(rest)
    if m:
        table, blocks = (_FLUX_DOUBLE, "transformer_blocks") if m.group(1) == "double" else \
            (_FLUX_SINGLE, "single_transformer_blocks")
        parts = table.get(m.group(3))
        return None if parts is None else [f"{blocks}.{m.group(2)}.{p}" for p in parts]
    return [_FLUX_OTHER[rest]] if rest in _FLUX_OTHER else None


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    # BFL's final adaLN emits (shift, scale); diffusers' norm_out expects (scale, shift).
    shift, scale = t.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


# --- SDXL: SGM block names <-> diffusers paths -----------------------------------------
_SGM_RESNET = {"in_layers.2": "conv1", "out_layers.3": "conv2", "emb_layers.1": "time_emb_proj",
               "skip_connection": "conv_shortcut"}
_SGM_TOP = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
            "label_emb.0.0": "add_embedding.linear_1", "label_emb.0.2": "add_embedding.linear_2",
            "input_blocks.0.0": "conv_in", "out.2": "conv_out"}


def _resnet_rest(rest: str, to_diffusers: bool) -> str:
    table = _SGM_RESNET if to_diffusers else {v: k for k, v in _SGM_RESNET.items()}
    return table.get(rest, rest)


def sgm_to_diffusers(path: str) -> str:
    """SDXL UNet path in SGM naming (input_blocks.4.1.…) to diffusers naming (down_blocks.1.attentions.0.…)."""
    for sgm, dif in _SGM_TOP.items():
        if path == sgm:
            return dif
    m = re.match(r"^(input_blocks|middle_block|output_blocks)\.(\d+)\.?(\d+)?\.(.+)$", path)
    if not m:
        return path
    kind, a, b, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    if kind == "middle_block":
        return f"mid_block.attentions.0.{rest}" if a == 1 else f"mid_block.resnets.{a // 2}.{_resnet_rest(rest, True)}"
    m_idx = int(b)
    if kind == "input_blocks":
        block, j = (a - 1) // 3, (a - 1) % 3
        if j == 2:
            return f"down_blocks.{block}.downsamplers.0.{'conv' if rest == 'op' else rest}"
        side = "down_blocks"
    else:
        block, j, side = a // 3, a % 3, "up_blocks"
    if m_idx == 0:
        return f"{side}.{block}.resnets.{j}.{_resnet_rest(rest, True)}"
    if rest == "conv":
        return f"{side}.{block}.upsamplers.0.conv"
    return f"{side}.{block}.attentions.{j}.{rest}"


def diffusers_to_sgm(path: str) -> str:
    """Inverse of `sgm_to_diffusers` for the SDXL UNet."""
    for sgm, dif in _SGM_TOP.items():
        if path == dif:
            return sgm
    m = re.match(r"^(down_blocks|up_blocks|mid_block)\.?(\d+)?\.(resnets|attentions|downsamplers|upsamplers)"
                 r"\.(\d+)\.(.+)$", path)
    if not m:
        return path
    side, block, kind, j, rest = m.group(1), m.group(2), m.group(3), int(m.group(4)), m.group(5)
    if side == "mid_block":
        return f"middle_block.1.{rest}" if kind == "attentions" else f"middle_block.{2 * j}.{_resnet_rest(rest, False)}"
    block = int(block)
    if kind == "downsamplers":
        return f"input_blocks.{3 * block + 3}.0.{'op' if rest == 'conv' else rest}"
    if kind == "upsamplers":
        return f"output_blocks.{3 * block + 2}.2.{rest}"  # SDXL: the upsampler follows an attention
    n = 3 * block + j + 1 if side == "down_blocks" else 3 * block + j
    head = "input_blocks" if side == "down_blocks" else "output_blocks"
    return f"{head}.{n}.{0 if kind == 'resnets' else 1}.{_resnet_rest(rest, False) if kind == 'resnets' else rest}"


# --- names ------------------------------------------------------------------------------
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


def detect_layout(state: Mapping[str, torch.Tensor], source: str) -> str:
    """"kohya" or "diffusers" (ai-toolkit Flux files share the diffusers layout); one-line error otherwise."""
    check_not_lycoris(state, source)
    for key in state:
        name, _, suffix = key.partition(".")
        if name.startswith("lora_") and suffix in KOHYA_SUFFIXES:
            return "kohya"
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


def _flux_dims(rest: str, out: int, n: int) -> list[int]:
    if n == 4:  # single block linear1: q, k, v (hidden each) and the MLP input (4·hidden)
        hidden = out // 7
        return [hidden, hidden, hidden, out - 3 * hidden]
    return [out // n] * n


def to_diffusers(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Kohya state dict to the diffusers/PEFT layout, alpha baked in (Flux: fused layers split)."""
    out: dict[str, torch.Tensor] = {}
    for name, m in group_modules(state, source).items():
        head, _, rest = name.partition("_")[2].partition("_")
        prefix = "lora_" + head
        flux = _flux_targets(rest) if prefix == "lora_unet" else None
        if flux is not None:
            if len(flux) > 1:
                for path, (a, b) in zip(flux, _split_fused(m, _flux_dims(rest, m.out_features, len(flux)))):
                    out[f"transformer.{path}.lora_A.weight"], out[f"transformer.{path}.lora_B.weight"] = a, b
                continue
            targets = [f"transformer.{flux[0]}"]
        elif prefix == "lora_unet":
            path = dotted(rest)
            targets = [f"unet.{sgm_to_diffusers(path)}"]
        elif prefix in _TE_PREFIXES:
            targets = [f"{_TE_PREFIXES[prefix]}.{dotted(rest)}"]
        else:
            raise UnsupportedLoraError(f"{source}: {name}: unexpected module prefix {prefix!r}; expected lora_unet, "
                                       f"lora_te, lora_te1, lora_te2 or lora_te3")
        sd, su = scale_split(m.scale)
        up = m.up * su
        if rest == "final_layer_adaLN_modulation_1":
            up = _swap_halves(up)
        out[f"{targets[0]}.lora_A.weight"], out[f"{targets[0]}.lora_B.weight"] = m.down * sd, up
    return out


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
            raise UnsupportedLoraError(f"{source}: unexpected key {key!r}; expected <unet|text_encoder|"
                                       f"text_encoder_2|transformer>.<module>.lora_A.weight / .lora_B.weight")
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


def _is_sdxl(groups: Mapping[str, dict]) -> bool:
    # SDXL has a second text encoder and no attention in its first down block.
    paths = list(groups)
    return any(p.startswith("text_encoder_2.") for p in paths) or (
        any(".down_blocks.1.attentions." in p for p in paths)
        and not any(".down_blocks.0.attentions." in p for p in paths))


def to_kohya(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Diffusers/PEFT (or ai-toolkit) state dict to kohya keys; alpha = rank (the scale is in the weights)."""
    groups = _peft_groups(state, source)
    flux = any(p.startswith("transformer.") for p in groups)
    sdxl = not flux and _is_sdxl(groups)
    flux_fused = {}
    for table, blocks in ((_FLUX_DOUBLE, "transformer_blocks"), (_FLUX_SINGLE, "single_transformer_blocks")):
        kind = "double" if blocks == "transformer_blocks" else "single"
        for path in groups:
            m = re.match(rf"^transformer\.{blocks}\.(\d+)\.", path)
            if m:
                for short, parts in table.items():
                    flux_fused.setdefault(f"lora_unet_{kind}_blocks_{m.group(1)}_{short}",
                                          [f"transformer.{blocks}.{m.group(1)}.{p}" for p in parts])
    other = {f"transformer.{v}": f"lora_unet_{k}" for k, v in _FLUX_OTHER.items()}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, paths in flux_fused.items():
        parts = [groups.get(p) for p in paths]
        if all(p is None for p in parts):
            continue
        used.update(p for p in paths if p in groups)
        if len(paths) == 1:
            down, up = parts[0]["down"], parts[0]["up"] * _peft_scale(parts[0])
        else:
            dims = None
            if len(paths) == 4:
                hidden = next(p["up"].shape[0] for p in parts[:3] if p is not None)
                mlp = parts[3]["up"].shape[0] if parts[3] is not None else 4 * hidden
                dims = [hidden, hidden, hidden, mlp]
            elif any(p is None for p in parts):
                dims = [next(p["up"].shape[0] for p in parts if p is not None)] * len(paths)
            down, up = _fuse(parts, dims)
        out.update(_kohya_module(name, down, up))
    for path, g in groups.items():
        if path in used:
            continue
        part, _, module = path.partition(".")
        if part == "transformer":
            if path not in other:
                raise UnsupportedLoraError(f"{source}: unexpected key {path}.lora_A.weight: not a Flux module")
            name = other[path]
            up = g["up"] * _peft_scale(g)
            up = _swap_halves(up) if name.endswith("adaLN_modulation_1") else up
        else:
            if part == "unet":
                name = "lora_unet_" + (diffusers_to_sgm(module) if sdxl else module).replace(".", "_")
            else:
                # Flux: CLIP-L is te1 and T5 te3; SDXL: te1 / te2; SD 1.x/2.x: te.
                te = ("lora_te1" if sdxl or flux else "lora_te") if part == "text_encoder" else \
                    ("lora_te3" if flux else "lora_te2")
                name = f"{te}_{module.replace('.', '_')}"
            up = g["up"] * _peft_scale(g)
        out.update(_kohya_module(name, g["down"], up))
    return out


def _kohya_module(name: str, down: torch.Tensor, up: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{name}.lora_down.weight": down.contiguous(), f"{name}.lora_up.weight": up.contiguous(),
            f"{name}.alpha": torch.tensor(float(down.shape[0]), dtype=down.dtype)}


def convert(state: Mapping[str, torch.Tensor], to: str, source: str) -> dict[str, torch.Tensor]:
    """Convert `state` (layout detected) to `to`: "kohya", "diffusers" or "ai-toolkit"."""
    if to not in LAYOUTS:
        raise UnsupportedLoraError(f"--to: expected one of {', '.join(LAYOUTS)}, got {to!r}")
    kohya = dict(state) if detect_layout(state, source) == "kohya" else to_kohya(state, source)
    if to == "kohya":
        return kohya
    return to_ai_toolkit(kohya, source) if to == "ai-toolkit" else to_diffusers(kohya, source)
