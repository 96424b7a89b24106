"""`--network_module networks.oft`: orthogonal fine-tuning of the UNet in sd-scripts' file layout.

Each adapted layer's output rows are split into `network_dim` blocks, and each block of the weight is turned
by an orthogonal matrix R = (I + Q)(I − Q)⁻¹, Q = B − Bᵀ the skew part of the trained `oft_blocks` B, its
norm clamped to `network_alpha × out_features` (sd-scripts' constraint). At multiplier m the rotation is
m·(R − I) + I. W' (block k, row m) = Σ_n R[k, n, m] · W (block k, row n), as sd-scripts computes it.

The file, as sd-scripts' networks/oft.py writes it (UNet only):

    oft_unet_<module path with _>.oft_blocks   [network_dim, out/network_dim, out/network_dim]
    oft_unet_<module path with _>.alpha        scalar (the constraint factor)

Targets: Linear layers (and 1x1 convs) inside the UNet's attention modules (to_q, to_k, to_v, to_out.0);
`enable_all_linear=True`: every Linear / 1x1 conv inside a Transformer2DModel; `enable_conv=True`: also the
convs of ResnetBlock2D, Downsample2D and Upsample2D. A file is read back with the same targets, which
sd-scripts infers from its names (`_ff_`: all linear; `in_layers_2` or resnet convs: conv).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from networks.network_base import AdapterNetwork, load_state_dict

PREFIX = "oft_unet"
ATTENTION_CLASSES = ("Attention", "CrossAttention")  # diffusers' name, sd-scripts' name
ALL_LINEAR_CLASSES = ("Transformer2DModel",)
CONV_CLASSES = ("ResnetBlock2D", "Downsample2D", "Upsample2D")


def truthy_arg(value: Any) -> bool:
    return str(value).lower() not in ("", "0", "false", "none", "no")


def block_rotation(oft_blocks: torch.Tensor, constraint: float, multiplier: float) -> torch.Tensor:
    """The per-block rotation m·(R − I) + I of sd-scripts' OFT, in float32: [blocks, size, size]."""
    blocks = oft_blocks.float()
    q = blocks - blocks.transpose(1, 2)
    norm = torch.norm(q.flatten())
    q = q * ((torch.clamp(norm, max=constraint) + 1e-8) / (norm + 1e-8))
    eye = torch.eye(q.shape[1], device=q.device).expand_as(q)
    r = torch.matmul(eye + q, torch.linalg.inv(eye - q))
    return multiplier * (r - eye) + eye


def rotated_weight(weight: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """W' with each block of output rows turned by its rotation (float32, W's shape)."""
    k, n, _ = rotation.shape
    w = weight.float().reshape(k, n, -1)
    return torch.einsum("knm,knp->kmp", rotation, w).reshape(weight.shape)


class OFTModule(nn.Module):
    """One adapted layer: replaces its forward (the layer itself stays in the model)."""

    def __init__(self, oft_name: str, org_module: nn.Module, multiplier: float = 1.0, dim: int = 4,
                 alpha: float = 1e-3):
        super().__init__()
        out_dim = org_module.out_features if isinstance(org_module, nn.Linear) else org_module.out_channels
        if dim < 1 or out_dim % dim:
            raise ValueError(f"{oft_name}: {out_dim} output features do not split into network_dim={dim} blocks")
        self.oft_name = oft_name
        self.num_blocks = dim
        self.block_size = out_dim // dim
        alpha = float(alpha)
        self.constraint = alpha * out_dim  # sd-scripts: alpha·out_dim (the paper: alpha·out_dim²)
        self.register_buffer("alpha", torch.tensor(alpha))
        self.oft_blocks = nn.Parameter(torch.zeros(dim, self.block_size, self.block_size))
        self.multiplier = multiplier
        self.org_module = [org_module]  # a list, so it is not a submodule
        self.org_forward = None

    def apply_to(self) -> None:
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def restore(self) -> None:
        if self.org_forward is not None:
            self.org_module[0].forward = self.org_forward
            self.org_forward = None

    def new_weight(self, multiplier: Optional[float] = None) -> torch.Tensor:
        m = self.multiplier if multiplier is None else multiplier
        return rotated_weight(self.org_module[0].weight, block_rotation(self.oft_blocks, self.constraint, m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.multiplier == 0.0:
            return self.org_forward(x)
        org = self.org_module[0]
        weight = self.new_weight().to(x.dtype)
        if isinstance(org, nn.Conv2d):
            return F.conv2d(x, weight, org.bias, org.stride, org.padding, org.dilation, org.groups)
        return F.linear(x, weight, org.bias)

    @torch.no_grad()
    def merge_to(self, multiplier: Optional[float] = None) -> None:
        org = self.org_module[0]
        org.weight.data = self.new_weight(multiplier).to(org.weight.dtype)


def target_layers(unet: nn.Module, enable_all_linear: bool, enable_conv: bool,
                  rename: Optional[Callable[[str], str]] = None) -> list[tuple[str, nn.Module]]:
    """(file name, layer) of every layer sd-scripts' OFTNetwork adapts, in model order. `rename`: the family's
    diffusers path -> the path sd-scripts' own UNet has (SDXL: SGM `input_blocks.4.1...`)."""
    classes = set(ALL_LINEAR_CLASSES if enable_all_linear else ATTENTION_CLASSES)
    if enable_conv:
        classes |= set(CONV_CLASSES)
    out, seen = [], set()
    for name, module in unet.named_modules():
        if type(module).__name__ not in classes:
            continue
        for child_name, child in module.named_modules():
            is_conv = isinstance(child, nn.Conv2d)
            if not (isinstance(child, nn.Linear) or (is_conv and (child.kernel_size == (1, 1) or enable_conv))):
                continue
            path = ".".join(p for p in (name, child_name) if p)
            oft_name = f"{PREFIX}_{(rename(path) if rename is not None else path).replace('.', '_')}"
            if oft_name not in seen:
                seen.add(oft_name)
                out.append((oft_name, child))
    return out


class OFTNetwork(AdapterNetwork):
    """sd-scripts' OFTNetwork API (create / apply / merge / optimizer groups / save) over a diffusers UNet."""

    def __init__(self, text_encoder: Any, unet: nn.Module, multiplier: float = 1.0, dim: int = 4,
                 alpha: float = 1e-3, enable_all_linear: bool = False, enable_conv: bool = False,
                 rename: Optional[Callable[[str], str]] = None) -> None:
        super().__init__()
        self.multiplier = multiplier
        self.dim, self.alpha = dim, alpha
        self.unet_ofts = [OFTModule(name, layer, multiplier, dim, alpha)
                          for name, layer in target_layers(unet, enable_all_linear, enable_conv, rename)]
        if not self.unet_ofts:
            raise ValueError("networks.oft: the model has no layer OFT adapts (it needs a UNet with attention)")
        for oft in self.unet_ofts:
            self.add_module(oft.oft_name, oft)
        self.text_encoder_loras: list = []  # OFT trains the UNet only
        self.unet_loras = self.unet_ofts

    def adapters(self) -> list[OFTModule]:
        return self.unet_ofts

    def load_weights(self, file: str):
        return self.load_state_dict(load_state_dict(file), False)

    def is_mergeable(self) -> bool:
        return True

    def merge_to(self, text_encoder, unet, weights_sd, dtype=None, device=None) -> None:
        self.load_state_dict(weights_sd, False)
        for oft in self.unet_ofts:
            oft.merge_to()

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        self.requires_grad_(True)
        group: dict[str, Any] = {"params": [p for oft in self.unet_ofts for p in oft.parameters()]}
        if unet_lr is not None:
            group["lr"] = unet_lr
        return [group], ["unet"]


def _unet_rename(lora_targets, unet: nn.Module) -> Optional[Callable[[str], str]]:
    """The family's rename of the UNet's paths (its LoRA target rooted at the UNet), if it has one."""
    for target in lora_targets or ():
        if target.root is unet and not target.is_text_encoder:
            return target.rename
    return None


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae, text_encoder,
                   unet, neuron_dropout: Optional[float] = None, lora_targets=None, block_layout=None,
                   **kwargs) -> OFTNetwork:
    """sd-scripts' defaults: 4 blocks, constraint factor 1e-3. `lora_targets` (the family's) give the names
    sd-scripts' own UNet has (SDXL: SGM paths)."""
    return OFTNetwork(text_encoder, unet, multiplier, 4 if network_dim is None else int(network_dim),
                      1e-3 if network_alpha is None else float(network_alpha),
                      enable_all_linear=truthy_arg(kwargs.get("enable_all_linear", False)),
                      enable_conv=truthy_arg(kwargs.get("enable_conv", False)), rename=_unet_rename(lora_targets, unet))


def settings_from_weights(weights_sd: dict) -> dict[str, Any]:
    """dim, alpha and targets of a saved OFT file, read as sd-scripts reads them."""
    dim = next((v.shape[0] for k, v in weights_sd.items() if k.endswith(".oft_blocks")), None)
    alpha = next((float(v) for k, v in weights_sd.items() if k.endswith(".alpha")), None)
    if dim is None or alpha is None:
        raise ValueError("networks.oft: the file has no .oft_blocks / .alpha tensors; not an OFT file")
    names = [k.split(".")[0] for k in weights_sd]
    return {"dim": dim, "alpha": alpha, "enable_all_linear": any("_ff_" in n for n in names),
            "enable_conv": any(("in_layers_2" in n or "_resnets_" in n or "samplers_" in n) for n in names)}


def create_network_from_weights(multiplier: float, file: str, vae, text_encoder, unet, weights_sd=None,
                                for_inference: bool = False, lora_targets=None, block_layout=None, **kwargs):
    if weights_sd is None:
        weights_sd = load_state_dict(file)
    s = settings_from_weights(weights_sd)
    network = OFTNetwork(text_encoder, unet, multiplier, s["dim"], s["alpha"], s["enable_all_linear"],
                         s["enable_conv"], rename=_unet_rename(lora_targets, unet))
    return network, weights_sd
