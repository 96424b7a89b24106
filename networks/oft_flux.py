"""`--network_module networks.oft_flux`: sd-scripts' OFT for FLUX.1, in its file layout (BFL module names).

The rotation is networks.oft's (R = (I + Q)(I − Q)⁻¹ per block of output rows, ‖Q‖ ≤ alpha × rows, multiplier m:
m·(R − I) + I). A fused BFL layer (`img_attn.qkv`, `txt_attn.qkv`, single blocks' `linear1`) is rotated per
part, as sd-scripts' `split_dims` does: one `oft_blocks.<i>` per projection (q, k, v and the MLP input), each
turning that projection's rows. The diffusers model holds those parts as separate Linears, so each is turned
by its own rotation, which is the same weight sd-scripts builds on the fused layer.

    oft_unet_<BFL block path with _>.oft_blocks.<i>   [network_dim, rows_i / network_dim, rows_i / network_dim]
    oft_unet_<BFL block path with _>.alpha            0-dim

Targets (sd-scripts): the attention layers of the double blocks (`img_attn.qkv`, `img_attn.proj`, `txt_attn.qkv`,
`txt_attn.proj`); `enable_all_linear=True`: every Linear of the double and single blocks. The module takes the
family's LoRA targets (kohya names and fused groups), so it knows FLUX.1 only through the names it writes.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from networks.lora_targets import LoraTarget, iter_target_groups
from networks.network_base import AdapterNetwork, load_state_dict
from networks.oft import block_rotation, rotated_weight, truthy_arg

PREFIX = "oft_unet_"
ATTN_ONLY = re.compile(r"^double_blocks_\d+_(img|txt)_attn_(qkv|proj)$")
IN_BLOCKS = re.compile(r"^(double|single)_blocks_\d+_")


class OFTFluxModule(nn.Module):
    """One BFL layer: one rotation per part (its diffusers Linears), each hooked into that Linear's forward."""

    def __init__(self, oft_name: str, parts: list[nn.Linear], multiplier: float = 1.0, dim: int = 4,
                 alpha: float = 1e-3):
        super().__init__()
        for part in parts:
            if dim < 1 or part.out_features % dim:
                raise ValueError(f"{oft_name}: {part.out_features} rows do not split into network_dim={dim} blocks")
        self.oft_name = oft_name
        self.num_blocks = dim
        alpha = float(alpha)
        self.register_buffer("alpha", torch.tensor(alpha))
        self.constraints = [alpha * p.out_features for p in parts]
        self.oft_blocks = nn.ParameterList([nn.Parameter(torch.zeros(dim, p.out_features // dim, p.out_features // dim))
                                            for p in parts])
        self.multiplier = multiplier
        self.parts = list(parts)  # a plain list: not submodules
        self.org_forwards: list = []

    def new_weight(self, i: int, multiplier: Optional[float] = None) -> torch.Tensor:
        m = self.multiplier if multiplier is None else multiplier
        return rotated_weight(self.parts[i].weight, block_rotation(self.oft_blocks[i], self.constraints[i], m))

    def _forward(self, i: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.multiplier == 0.0:
                return self.org_forwards[i](x)
            part = self.parts[i]
            return F.linear(x, self.new_weight(i).to(x.dtype), part.bias)
        return forward

    def apply_to(self) -> None:
        self.org_forwards = [p.forward for p in self.parts]
        for i, part in enumerate(self.parts):
            part.forward = self._forward(i)

    def restore(self) -> None:
        for part, forward in zip(self.parts, self.org_forwards):
            part.forward = forward
        self.org_forwards = []

    @torch.no_grad()
    def merge_to(self, multiplier: Optional[float] = None) -> None:
        for i, part in enumerate(self.parts):
            part.weight.data = self.new_weight(i, multiplier).to(part.weight.dtype)


def target_groups(targets: list[LoraTarget], enable_all_linear: bool) -> list[tuple[str, list[nn.Linear]]]:
    """(file name, diffusers Linears in slot order) of every BFL layer sd-scripts' OFT adapts."""
    out = []
    for target in targets:
        if target.is_text_encoder or target.enabled_by is not None or not target.prefix.startswith("lora_unet"):
            continue
        for name, members in iter_target_groups(target, include_conv=False):
            tail = name[len(target.prefix) + 1:]
            if not IN_BLOCKS.match(tail) or not (enable_all_linear or ATTN_ONLY.match(tail)):
                continue
            if all(isinstance(m, nn.Linear) for m in members):
                out.append((PREFIX + tail, list(members)))
    return out


class OFTFluxNetwork(AdapterNetwork):
    """sd-scripts' OFTNetwork (FLUX.1) API over the family's targets."""

    def __init__(self, targets: list[LoraTarget], multiplier: float = 1.0, dim: int = 4, alpha: float = 1e-3,
                 enable_all_linear: bool = False) -> None:
        super().__init__()
        self.multiplier = multiplier
        self.unet_ofts = [OFTFluxModule(name, parts, multiplier, dim, alpha)
                          for name, parts in target_groups(targets, enable_all_linear)]
        if not self.unet_ofts:
            raise ValueError("networks.oft_flux: the model has no FLUX.1 double / single block to adapt "
                             "(use networks.oft for SD 1.x/2.x)")
        for oft in self.unet_ofts:
            self.add_module(oft.oft_name, oft)
        self.text_encoder_loras: list = []
        self.unet_loras = self.unet_ofts

    def adapters(self) -> list[OFTFluxModule]:
        return self.unet_ofts

    def load_weights(self, file, source: Optional[str] = None):
        state = load_state_dict(file) if isinstance(file, (str, os.PathLike)) else dict(file)
        return self.load_state_dict(state, False)

    def is_mergeable(self) -> bool:
        return True

    def merge_to(self, text_encoder=None, unet=None, weights_sd=None, dtype=None, device=None) -> None:
        if weights_sd is not None:
            self.load_state_dict(weights_sd, False)
        for oft in self.unet_ofts:
            oft.merge_to()

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        self.requires_grad_(True)
        group: dict[str, Any] = {"params": list(self.parameters())}
        if unet_lr is not None:
            group["lr"] = unet_lr
        return [group], ["unet"]


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae, text_encoder,
                   unet, neuron_dropout: Optional[float] = None, lora_targets=None, block_layout=None,
                   **kwargs: Any) -> OFTFluxNetwork:
    if lora_targets is None:
        raise ValueError("networks.oft_flux: needs the family's LoRA targets (run it through a FLUX.1 script)")
    return OFTFluxNetwork(list(lora_targets), multiplier, 4 if network_dim is None else int(network_dim),
                          1e-3 if network_alpha is None else float(network_alpha),
                          enable_all_linear=truthy_arg(kwargs.get("enable_all_linear", False)))


def create_network_from_weights(multiplier: float, file, vae, text_encoder, unet, weights_sd=None,
                                for_inference: bool = False, lora_targets=None, block_layout=None, **kwargs: Any):
    if weights_sd is None:
        weights_sd = load_state_dict(file)
    dim = next((v.shape[0] for k, v in weights_sd.items() if ".oft_blocks." in k), None)
    alpha = next((float(v) for k, v in weights_sd.items() if k.endswith(".alpha")), None)
    if dim is None or alpha is None:
        raise ValueError("networks.oft_flux: the file has no .oft_blocks.<i> / .alpha tensors; not an OFT file")
    names = {k.split(".")[0] for k in weights_sd}
    all_linear = any(not ATTN_ONLY.match(n[len(PREFIX):]) for n in names)
    network = OFTFluxNetwork(list(lora_targets or []), multiplier, dim, alpha, all_linear)
    return network, weights_sd
