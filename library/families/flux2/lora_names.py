"""FLUX.2's LoRA names and the LoRA file layouts it reads.

- kohya / musubi-tuner (networks.lora_flux2 here, networks.lora_flux_2 there; both on BFL's modules):
  `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight` / `lora_up` / `alpha`, what ComfyUI and diffusers'
  Flux2 loader read; returned as they are;
- ai-toolkit / ComfyUI's own names: `diffusion_model.<BFL path>.lora_A.weight` / `lora_B.weight` (or
  `lora_down` / `lora_up`, with or without `alpha`): renamed, alpha = rank (scale 1) when absent;
- diffusers / PEFT names (`transformer.transformer_blocks.0.attn.to_q.lora_A.weight`, or under `diffusion_model.`):
  each module mapped to its BFL module; q, k and v (separate A and B each) fused into one kohya module whose down
  stacks the three downs and whose up is block-diagonal (rank 3r, the same product), each part's own scale folded
  into its up so that one alpha (= 3r) serves all three.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from library.families.flux2 import layout

LORA_PREFIX = "lora_unet_"
_KEY = re.compile(r"^(?:diffusion_model\.|transformer\.|base_model\.model\.)(.+)\."
                  r"(lora_A\.weight|lora_B\.weight|lora_down\.weight|lora_up\.weight|alpha)$")
_SUFFIX = {"lora_A.weight": "down", "lora_down.weight": "down", "lora_B.weight": "up", "lora_up.weight": "up",
           "alpha": "alpha"}


def kohya_name(bfl_path: str) -> str:
    return LORA_PREFIX + bfl_path.replace(".", "_")


def to_kohya_lora(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A FLUX.2 LoRA in ai-toolkit's / ComfyUI's / diffusers' names -> kohya names (lora_down / lora_up / alpha); a
    file already in kohya names comes back as it is."""
    if not any(_KEY.match(k) for k in state):
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        m = _KEY.match(key)
        if m is None:
            out[key] = value
            continue
        modules.setdefault(m[1], {})[_SUFFIX[m[2]]] = value
    fused: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for path, parts in modules.items():
        if "down" not in parts or "up" not in parts:
            raise ValueError(f"{path}: a LoRA module needs both its down (lora_A) and up (lora_B) weights")
        down, up = parts["down"], parts["up"]
        rank = down.shape[0]
        scale = float(parts["alpha"]) / rank if "alpha" in parts else 1.0
        bfl, slot = layout.original_module(path)
        if slot is None:
            name = kohya_name(bfl)
            out[f"{name}.lora_down.weight"] = down
            out[f"{name}.lora_up.weight"] = up
            out[f"{name}.alpha"] = torch.tensor(float(rank) * scale)
        else:
            fused.setdefault(bfl, {})[slot] = (down, up * scale)
    for bfl, slots in fused.items():
        if sorted(slots) != [0, 1, 2]:
            raise ValueError(f"{bfl}: q, k and v LoRA parts expected together, found slots {sorted(slots)}")
        downs = [slots[i][0] for i in range(3)]
        ups = [slots[i][1] for i in range(3)]
        name = kohya_name(bfl)
        out[f"{name}.lora_down.weight"] = torch.cat(downs, dim=0)
        out[f"{name}.lora_up.weight"] = torch.block_diag(*ups)
        out[f"{name}.alpha"] = torch.tensor(float(sum(d.shape[0] for d in downs)))
    return out


_LINEAR = re.compile(r"single_blocks[._]0[._](linear1|linear2)\.(lora_up|lora_B|lora_down|lora_A)\.weight$")


def is_flux2_lora(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bool:
    """Whether a LoRA file (any layout) is FLUX.2's: its metadata says so, it names FLUX.2-only diffusers modules
    (`ff.linear_in`, `to_qkv_mlp_proj`), or its first single block's shapes are FLUX.2's (linear1 out 9 x width for
    q, k, v and the SwiGLU MLP input, linear2 in 4 x width; FLUX.1 has 7 and 5)."""
    if (metadata or {}).get("ss_base_model_version") == "flux2":
        return True
    if any(".ff.linear_in." in k or ".to_qkv_mlp_proj." in k for k in state):
        return True
    out = into = None
    for key, value in state.items():
        m = _LINEAR.search(key)
        if m and m[1] == "linear1" and m[2] in ("lora_up", "lora_B"):
            out = value.shape[0]
        elif m and m[1] == "linear2" and m[2] in ("lora_down", "lora_A"):
            into = value.shape[1]
    return out is not None and into is not None and out * 4 == into * 9


def layout_name(state: Mapping[str, torch.Tensor]) -> str:
    """"kohya" (lora_unet_… names), "comfy" (lora_down / lora_up under diffusion_model.) or "diffusers" (lora_A /
    lora_B: diffusers' and ai-toolkit's) of a FLUX.2 file, as tools/convert_lora.py names layouts."""
    if any(k.startswith(LORA_PREFIX) for k in state):
        return "kohya"
    return "comfy" if any(k.endswith(".lora_down.weight") for k in state) else "diffusers"


def _modules(kohya: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in kohya.items():
        name, _, suffix = key.partition(".")
        modules.setdefault(name, {})[suffix] = value
    return modules


def bfl_path(name: str) -> str:
    """`lora_unet_double_blocks_0_img_attn_qkv` -> `double_blocks.0.img_attn.qkv` (BFL's module paths)."""
    rest = name[len(LORA_PREFIX):]
    m = re.match(r"^(double_blocks|single_blocks)_(\d+)_(.+)$", rest)
    if not m:
        raise ValueError(f"{name}: not a FLUX.2 block module (lora_unet_double_blocks_N_… / single_blocks_N_…)")
    inner = m[3]
    for stream in ("img_attn", "txt_attn", "img_mlp", "txt_mlp"):
        if inner.startswith(stream + "_"):
            inner = stream + "." + inner[len(stream) + 1:]
    return f"{m[1]}.{m[2]}.{inner}"


def _only_transformer(kohya: Mapping[str, torch.Tensor], to: str) -> None:
    other = next((k for k in kohya if not k.startswith(LORA_PREFIX)), None)
    if other is not None:
        raise ValueError(f"the {to} layout holds the FLUX.2 transformer's modules only; this file also has {other!r} "
                         f"(a text-encoder LoRA): convert a file trained with --network_train_unet_only")


def kohya_to_bfl_peft(kohya: Mapping[str, torch.Tensor], down: str = "lora_A.weight", up: str = "lora_B.weight",
                      with_alpha: bool = False) -> dict[str, torch.Tensor]:
    """kohya names -> `diffusion_model.<BFL path>.lora_A` / `lora_B` (ai-toolkit's layout: the scale alpha / rank
    folded into B) or, with `with_alpha`, ComfyUI's own `lora_down` / `lora_up` / `alpha` under the same paths."""
    _only_transformer(kohya, "ai-toolkit / comfy")
    out = {}
    for name, parts in _modules(kohya).items():
        path = "diffusion_model." + bfl_path(name)
        rank = parts["lora_down.weight"].shape[0]
        alpha = float(parts["alpha"]) if "alpha" in parts else float(rank)
        out[f"{path}.{down}"] = parts["lora_down.weight"]
        if with_alpha:
            out[f"{path}.{up}"] = parts["lora_up.weight"]
            out[f"{path}.alpha"] = torch.tensor(alpha)
        else:
            out[f"{path}.{up}"] = parts["lora_up.weight"] * (alpha / rank)
    return out


def kohya_to_diffusers(kohya: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kohya names -> diffusers' PEFT names (`transformer.transformer_blocks.0.attn.to_q.lora_A.weight`, the fused
    qkv split), by diffusers' own kohya FLUX.2 converter (what Flux2 pipelines' load_lora_weights applies)."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux2_lora_to_diffusers

    _only_transformer(kohya, "diffusers")
    state = {k: v.clone() for k, v in kohya.items()}
    out = _convert_kohya_flux2_lora_to_diffusers(state)
    if state:
        raise ValueError(f"modules diffusers' FLUX.2 converter does not place: {sorted(state)[:3]}")
    return out
