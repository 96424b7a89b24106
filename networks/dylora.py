"""`--network_module networks.dylora`: DyLoRA as sd-scripts' networks/dylora.py trains it, in the LoRA file layout.

Each module keeps its rank as `network_dim` separate rows (lora_down rows, lora_up columns). Every training
forward draws b, a multiple of `unit` below the rank, trains only rows [b, b + unit) and scales the update by
sqrt(rank / (b + unit)), so any prefix of the rows works as a LoRA of that rank
(tools/extract_lora_from_dylora.py cuts them). Outside training the whole rank is used at scale 1 (sd-scripts
draws b there too, so its images change from call to call).

The file is a plain LoRA (`lora_down.weight` [rank, in(, k, k)], `lora_up.weight` [out, rank(, 1, 1)], `alpha`)
under the family's kohya names. --network_args: `unit` (default 1; the rank must be a multiple),
`conv_dim` (must equal network_dim; adds the 3x3 convs of ResnetBlock2D / Downsample2D / Upsample2D) and
`conv_alpha` (default 1).
"""

from __future__ import annotations

import math
import os
import random
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from networks.lora_targets import LoraTarget, default_lora_targets, iter_target_modules
from networks.network_base import AdapterNetwork, load_state_dict


class DyLoRAModule(nn.Module):
    """One adapted Linear / Conv2d: rank rows that train a unit at a time."""

    def __init__(self, lora_name: str, org_module: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: Any = 1.0, unit: int = 1):
        super().__init__()
        if lora_dim % unit:
            raise ValueError(f"networks.dylora: the rank ({lora_dim}) must be a multiple of unit ({unit})")
        self.lora_name, self.lora_dim, self.unit = lora_name, lora_dim, unit
        self.is_conv = isinstance(org_module, nn.Conv2d)
        self.kernel = tuple(org_module.kernel_size) if self.is_conv else ()
        in_dim = org_module.in_channels if self.is_conv else org_module.in_features
        out_dim = org_module.out_channels if self.is_conv else org_module.out_features
        alpha = float(alpha) if alpha is not None and float(alpha) != 0 else float(lora_dim)
        self.scale = alpha / lora_dim
        self.register_buffer("alpha", torch.tensor(alpha))
        w = org_module.weight
        self.lora_A = nn.ParameterList([nn.Parameter(w.new_zeros((1, in_dim, *self.kernel))) for _ in range(lora_dim)])
        self.lora_B = nn.ParameterList([nn.Parameter(w.new_zeros((out_dim, 1, *([1] * len(self.kernel)))))
                                        for _ in range(lora_dim)])
        for row in self.lora_A:
            nn.init.kaiming_uniform_(row, a=math.sqrt(5))
        self.multiplier = multiplier
        self.org_module = [org_module]
        self.org_forward = None

    def apply_to(self) -> None:
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def restore(self) -> None:
        if self.org_forward is not None:
            self.org_module[0].forward = self.org_forward
            self.org_forward = None

    def down(self) -> torch.Tensor:
        return torch.cat(tuple(self.lora_A), dim=0)

    def up(self) -> torch.Tensor:
        return torch.cat(tuple(self.lora_B), dim=1)

    def _trained_rank(self) -> int:
        """b: the first row that trains this step (sd-scripts: random.randint, a multiple of unit)."""
        b = random.randint(0, self.lora_dim - 1)
        b -= b % self.unit
        for i, (a_row, b_row) in enumerate(zip(self.lora_A, self.lora_B)):
            on = b <= i < b + self.unit
            a_row.requires_grad_(on)
            b_row.requires_grad_(on)
        return b

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.org_forward(x, *args, **kwargs)
        b = self._trained_rank() if self.training else self.lora_dim - self.unit
        down, up = self.down().to(x.dtype), self.up().to(x.dtype)
        if self.is_conv:
            org = self.org_module[0]
            h = F.conv2d(x, down, None, org.stride, org.padding, org.dilation, org.groups)
            h = F.conv2d(h, up)
        else:
            h = F.linear(F.linear(x, down), up)
        return out + h * (self.multiplier * self.scale * math.sqrt(self.lora_dim / (b + self.unit)))

    def delta_weight(self) -> torch.Tensor:
        """ΔW at full rank, scale 1 of the rank factor (what merging adds)."""
        from networks.lora_math import delta_weight

        return delta_weight(self.down().float(), self.up().float(), self.alpha)

    def kohya_state(self) -> dict[str, torch.Tensor]:
        return {f"{self.lora_name}.lora_down.weight": self.down().detach(),
                f"{self.lora_name}.lora_up.weight": self.up().detach(), f"{self.lora_name}.alpha": self.alpha}

    @torch.no_grad()
    def load_kohya(self, down: torch.Tensor, up: torch.Tensor) -> None:
        down = down.reshape(self.lora_dim, *self.lora_A[0].shape[1:])
        up = up.reshape(up.shape[0], self.lora_dim, *self.lora_B[0].shape[2:])
        for i in range(self.lora_dim):
            self.lora_A[i].copy_(down[i:i + 1])
            self.lora_B[i].copy_(up[:, i:i + 1])


def _modules_of(targets: list[LoraTarget], apply_to_conv: bool, modules_dim: Optional[dict] = None
                ) -> list[tuple[str, nn.Module, bool]]:
    """(kohya name, layer, is_text_encoder) of each layer sd-scripts' DyLoRANetwork adapts."""
    out = []
    for target in targets:
        if target.fused_slot is not None:
            raise ValueError("networks.dylora: this model's LoRA layout fuses layers (FLUX.1); DyLoRA is for "
                             "SD 1.x/2.x and SDXL, as in sd-scripts")
        if target.enabled_by is not None and modules_dim is None:
            continue  # optional targets: only a file turns them on
        for name, layer in iter_target_modules(target, include_conv=apply_to_conv or modules_dim is not None):
            if modules_dim is not None:
                if name in modules_dim:
                    out.append((name, layer, target.is_text_encoder))
                continue
            if isinstance(layer, nn.Linear) or tuple(layer.kernel_size) == (1, 1) or apply_to_conv:
                out.append((name, layer, target.is_text_encoder))
    return out


class DyLoRANetwork(AdapterNetwork):
    """sd-scripts' DyLoRANetwork API over the family's LoRA targets."""

    def __init__(self, targets: list[LoraTarget], multiplier: float = 1.0, lora_dim: int = 4, alpha: float = 1.0,
                 apply_to_conv: bool = False, unit: int = 1, conv_alpha: Optional[float] = None,
                 modules_dim: Optional[dict] = None, modules_alpha: Optional[dict] = None) -> None:
        super().__init__()
        self.multiplier = multiplier
        self.text_encoder_loras: list[DyLoRAModule] = []
        self.unet_loras: list[DyLoRAModule] = []
        for name, layer, is_te in _modules_of(targets, apply_to_conv, modules_dim):
            if modules_dim is not None:
                dim, a = modules_dim[name], modules_alpha.get(name, modules_dim[name])
            else:
                is_3x3 = isinstance(layer, nn.Conv2d) and tuple(layer.kernel_size) != (1, 1)
                dim, a = lora_dim, (conv_alpha if is_3x3 and conv_alpha is not None else alpha)
            module = DyLoRAModule(name, layer, multiplier, dim, a, unit if modules_dim is None else 1)
            (self.text_encoder_loras if is_te else self.unet_loras).append(module)
            self.add_module(name, module)

    def adapters(self) -> list[DyLoRAModule]:
        return self.text_encoder_loras + self.unet_loras

    def apply_to(self, text_encoder=None, unet=None, apply_text_encoder=True, apply_unet=True) -> None:
        if not apply_text_encoder:
            self.text_encoder_loras = []
        if not apply_unet:
            self.unet_loras = []
        super().apply_to()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """The LoRA layout (lora_down / lora_up / alpha), as sd-scripts saves DyLoRA."""
        out: dict[str, torch.Tensor] = {}
        for m in self.text_encoder_loras + self.unet_loras:
            out.update(m.kohya_state())
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        from torch.nn.modules.module import _IncompatibleKeys

        modules = {m.lora_name: m for m in self.text_encoder_loras + self.unet_loras}
        seen: set[str] = set()
        unexpected = []
        for key in state_dict:
            name, _, part = key.partition(".")
            if name not in modules or part not in ("lora_down.weight", "lora_up.weight", "alpha"):
                unexpected.append(key)
        for name, m in modules.items():
            down, up = state_dict.get(f"{name}.lora_down.weight"), state_dict.get(f"{name}.lora_up.weight")
            if down is not None and up is not None:
                m.load_kohya(down, up)
                seen.update({f"{name}.lora_down.weight", f"{name}.lora_up.weight"})
            if f"{name}.alpha" in state_dict:
                m.alpha.copy_(state_dict[f"{name}.alpha"])
                m.scale = float(m.alpha) / m.lora_dim
                seen.add(f"{name}.alpha")
        missing = [k for k in self.state_dict() if k not in seen]
        if strict and (missing or unexpected):
            raise RuntimeError(f"networks.dylora: missing keys {missing[:3]}, unexpected keys {unexpected[:3]}")
        return _IncompatibleKeys(missing, unexpected)

    def load_weights(self, file, source: Optional[str] = None):
        state = load_state_dict(file) if isinstance(file, (str, os.PathLike)) else dict(file)
        return self.load_state_dict(state, False)

    def is_mergeable(self) -> bool:
        return True

    @torch.no_grad()
    def merge_to(self, text_encoder=None, unet=None, weights_sd=None, dtype=None, device=None) -> None:
        if weights_sd is not None:
            self.load_state_dict(weights_sd, False)
        for m in self.text_encoder_loras + self.unet_loras:
            org = m.org_module[0]
            dw = m.delta_weight().reshape(org.weight.shape) * m.multiplier
            org.weight.data = (org.weight.float() + dw.to(org.weight.device)).to(org.weight.dtype)

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        self.requires_grad_(True)
        if isinstance(text_encoder_lr, (list, tuple)):
            text_encoder_lr = text_encoder_lr[0] if text_encoder_lr else None
        groups, names = [], []
        for loras, lr, name in ((self.text_encoder_loras, text_encoder_lr, "textencoder"),
                                (self.unet_loras, unet_lr, "unet")):
            lr = default_lr if lr is None else lr
            params = [p for m in loras for p in m.parameters()]
            if params and lr:
                groups.append({"params": params, "lr": lr})
                names.append(name)
        return groups, names


def _targets(lora_targets, text_encoder, unet) -> list[LoraTarget]:
    return list(lora_targets) if lora_targets is not None else default_lora_targets(text_encoder, unet)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae, text_encoder,
                   unet, neuron_dropout: Optional[float] = None, lora_targets=None, block_layout=None,
                   **kwargs: Any) -> DyLoRANetwork:
    """sd-scripts' defaults: rank 4, alpha 1, unit 1; conv_dim must equal network_dim."""
    dim = 4 if network_dim is None else int(network_dim)
    conv_dim = kwargs.get("conv_dim")
    if conv_dim is not None and int(conv_dim) != dim:
        raise ValueError(f"networks.dylora: conv_dim ({conv_dim}) must equal network_dim ({dim})")
    return DyLoRANetwork(_targets(lora_targets, text_encoder, unet), multiplier, dim,
                         1.0 if network_alpha is None else float(network_alpha), apply_to_conv=conv_dim is not None,
                         unit=int(kwargs.get("unit", 1)),
                         conv_alpha=float(kwargs["conv_alpha"]) if kwargs.get("conv_alpha") is not None else None)


def create_network_from_weights(multiplier: float, file, vae, text_encoder, unet, weights_sd=None,
                                for_inference: bool = False, lora_targets=None, block_layout=None, **kwargs: Any):
    if weights_sd is None:
        weights_sd = load_state_dict(file)
    modules_dim = {k.split(".")[0]: v.shape[0] for k, v in weights_sd.items() if k.endswith(".lora_down.weight")}
    modules_alpha = {k.split(".")[0]: float(v) for k, v in weights_sd.items() if k.endswith(".alpha")}
    network = DyLoRANetwork(_targets(lora_targets, text_encoder, unet), multiplier, modules_dim=modules_dim,
                            modules_alpha=modules_alpha)
    if for_inference:
        network.eval()
    return network, weights_sd


def split_ranks(state: dict[str, torch.Tensor], unit: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """sd-scripts' extract_lora_from_dylora: the LoRA of each rank unit, 2·unit, ... below the largest rank (the
    first rows of lora_down, columns of lora_up; alpha as it is)."""
    if unit < 1:
        raise ValueError(f"--unit: expected an integer >= 1, got {unit}")
    max_rank = max((v.shape[0] for k, v in state.items() if k.endswith(".lora_down.weight")), default=0)
    out = []
    for rank in range(unit, max_rank, unit):
        cut = {}
        for key, value in state.items():
            if key.endswith(".lora_down.weight"):
                cut[key] = value[:rank].contiguous()
            elif key.endswith(".lora_up.weight"):
                cut[key] = value[:, :rank].contiguous()
            else:
                cut[key] = value
        out.append((rank, cut))
    return out
