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
