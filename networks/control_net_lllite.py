"""ControlNet-LLLite for SDXL (`--network_module networks.control_net_lllite`), in sd-scripts' file format.

A LLLite module sits in front of one Linear of the UNet's transformer blocks: it embeds the conditioning image
(`conditioning1`, a few strided convs down to the block's latent resolution), reduces the Linear's input
(`down`), mixes both (`mid`) and adds the result, brought back to the input width (`up`), to the Linear's input.
Which Linears get one, and the names, follow sd-scripts' networks/control_net_lllite.py (its defaults): the
self-attention q, k, v and the cross-attention q of every transformer block of the input blocks and the middle
block (the output blocks are skipped), named by the layer's SGM path:

    lllite_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.{conditioning1.0,down.0,mid.0,up.0}.{weight,bias}

which is also what ComfyUI's LLLite loader (kohya-ss/ControlNet-LLLite-ComfyUI) reads: 136 modules on SDXL.
The conditioning image is RGB in [-1, 1] at the target image's pixel size. The module knows no model family:
the caller passes the family's rename of a diffusers path to its SGM path (the `lora_targets` the loop gives
every network module; the target with prefix "lora_unet" carries it).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from library.core.errors import ConfigError, UserError
from networks.network_base import AdapterNetwork, load_state_dict

logger = logging.getLogger(__name__)

PREFIX = "lllite_unet"
TARGET_CLASSES = ("Transformer2DModel",)
ARCHITECTURE_SUFFIX = "/control-net-lllite"  # modelspec.architecture of sd-scripts' files
_SGM_PATH = re.compile(r"^(input_blocks|middle_block|output_blocks)\.(\d+)\.")


def lllite_depth(sgm_path: str) -> Optional[int]:
    """The conditioning depth (1-3: the embedding's downscale 8x, 16x, 32x) of the Linear at SGM path `sgm_path`,
    or None when sd-scripts' rule gives it no module: only attn1.to_q/k/v and attn2.to_q, in the input and
    middle blocks."""
    m = _SGM_PATH.match(sgm_path)
    if m is None:
        return None
    tail = sgm_path.rsplit(".", 2)
    if len(tail) < 3 or (tail[-2], tail[-1]) not in (("attn1", "to_q"), ("attn1", "to_k"), ("attn1", "to_v"),
                                                     ("attn2", "to_q")):
        return None
    block, index = m[1], int(m[2])
    if block == "input_blocks":
        return 1 if index <= 2 else (2 if index <= 5 else 3)
    if block == "middle_block":
        return 3
    return None  # output blocks: skipped, as sd-scripts' SKIP_OUTPUT_BLOCKS


def lllite_name(sgm_path: str) -> str:
    """The module name in files: `lllite_unet_` + the SGM path with dots as underscores."""
    return f"{PREFIX}_{sgm_path.replace('.', '_')}"


def conditioning_embedding(depth: int, cond_emb_dim: int) -> nn.Sequential:
    """Conditioning image (3 channels, pixel size) -> cond_emb_dim channels at 1/8, 1/16 or 1/32 of it."""
    half = cond_emb_dim // 2
    layers: list[nn.Module] = [nn.Conv2d(3, half, kernel_size=4, stride=4)]  # the latent size / 2
    if depth == 1:
        layers += [nn.ReLU(inplace=True), nn.Conv2d(half, cond_emb_dim, kernel_size=2, stride=2)]
    elif depth == 2:
        layers += [nn.ReLU(inplace=True), nn.Conv2d(half, cond_emb_dim, kernel_size=4, stride=4)]
    elif depth == 3:
        layers += [nn.ReLU(inplace=True), nn.Conv2d(half, half, kernel_size=4, stride=4),
                   nn.ReLU(inplace=True), nn.Conv2d(half, cond_emb_dim, kernel_size=2, stride=2)]
    else:
        raise ValueError(f"LLLite depth: expected 1, 2 or 3, got {depth}")
    return nn.Sequential(*layers)


def depth_of_weights(weights: Mapping[str, torch.Tensor], name: str) -> int:
    """A saved module's depth, read from its conditioning layers (as ComfyUI's loader reads it)."""
    if f"{name}.conditioning1.4.weight" in weights:
        return 3
    return 2 if weights[f"{name}.conditioning1.2.weight"].shape[-1] == 4 else 1


class LLLiteModule(nn.Module):
    """One LLLite module in front of `org_module` (an nn.Linear); its output is added to the Linear's input."""

    def __init__(self, name: str, org_module: nn.Linear, depth: int, cond_emb_dim: int, mlp_dim: int,
                 dropout: Optional[float] = None, multiplier: float = 1.0):
        super().__init__()
        self.lllite_name = name
        self.depth = depth
        self.dropout = dropout
        self.multiplier = multiplier
        self.org_module = [org_module]  # a list: not a submodule (its weights are the UNet's, not ours)
        in_dim = org_module.in_features
        self.conditioning1 = conditioning_embedding(depth, cond_emb_dim)
        self.down = nn.Sequential(nn.Linear(in_dim, mlp_dim), nn.ReLU(inplace=True))
        self.mid = nn.Sequential(nn.Linear(mlp_dim + cond_emb_dim, mlp_dim), nn.ReLU(inplace=True))
        self.up = nn.Sequential(nn.Linear(mlp_dim, in_dim))
        nn.init.zeros_(self.up[0].weight)  # as sd-scripts: a zero weight (the bias keeps its default init)
        self.cond_image: Optional[torch.Tensor] = None
        self._cond_emb: Optional[torch.Tensor] = None
        self.org_forward: Optional[Callable] = None

    def set_cond_image(self, cond_image: Optional[torch.Tensor]) -> None:
        self.cond_image = cond_image
        self._cond_emb = None

    def _embedding(self, like: torch.Tensor) -> torch.Tensor:
        """The conditioning image's embedding as tokens (b, h*w, c). Recomputed in every forward that records
        gradients (the embedding trains, and gradient checkpointing reruns the forward); kept otherwise."""
        if self._cond_emb is not None and not torch.is_grad_enabled():
            return self._cond_emb
        image = self.cond_image.to(like.device, like.dtype)
        cx = self.conditioning1(image)
        n, c, h, w = cx.shape
        cx = cx.view(n, c, h * w).permute(0, 2, 1)
        if not torch.is_grad_enabled():
            self._cond_emb = cx
        return cx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.multiplier == 0.0 or self.cond_image is None:
            return self.org_forward(x)
        cx = self._embedding(x)
        if cx.shape[1] != x.shape[1]:
            raise UserError(f"ControlNet-LLLite {self.lllite_name}: the conditioning image gives {cx.shape[1]} "
                            f"tokens but the layer sees {x.shape[1]}; expected a conditioning image of the target "
                            "image's pixel size")
        if x.shape[0] != cx.shape[0]:  # classifier-free guidance: the batch is (uncond, cond) of one image batch
            cx = cx.repeat(x.shape[0] // cx.shape[0], 1, 1)
        cx = self.mid(torch.cat([cx, self.down(x)], dim=2))
        if self.dropout is not None and self.training:
            cx = nn.functional.dropout(cx, p=self.dropout)
        return self.org_forward(x + self.up(cx) * self.multiplier)

    def apply_to(self) -> None:
        org = self.org_module[0]
        self._org_had_own_forward = "forward" in vars(org)  # another hook was there first: give it back
        self.org_forward = org.forward
        org.forward = self.forward

    def restore(self) -> None:
        """Give the Linear its own forward back."""
        if self.org_forward is None:
            return
        org = self.org_module[0]
        if self._org_had_own_forward:
            org.forward = self.org_forward
        else:
            del org.forward
        self.org_forward = None


def lllite_targets(unet: nn.Module, rename: Optional[Callable[[str], str]]) -> list[tuple[str, nn.Linear, int]]:
    """(name, Linear, depth) of every module sd-scripts' rule gives the UNet, in module order. `rename`: the
    family's diffusers path -> SGM path (None: the paths are SGM paths already, as in sd-scripts' own UNet)."""
    found = []
    for path, module in unet.named_modules():
        if type(module).__name__ not in TARGET_CLASSES:
            continue
        for child_path, child in module.named_modules():
            if not isinstance(child, nn.Linear):
                continue
            full = f"{path}.{child_path}"
            sgm = rename(full) if rename is not None else full
            depth = lllite_depth(sgm)
            if depth is not None:
                found.append((lllite_name(sgm), child, depth))
    return found


class ControlNetLLLite(AdapterNetwork):
    """Every LLLite module of one SDXL UNet, registered under its file name (so state_dict() is the file)."""

    def __init__(self, unet: nn.Module, cond_emb_dim: int = 16, mlp_dim: int = 16, dropout: Optional[float] = None,
                 multiplier: float = 1.0, rename: Optional[Callable[[str], str]] = None):
        super().__init__()
        self.cond_emb_dim, self.mlp_dim, self.multiplier = cond_emb_dim, mlp_dim, multiplier
        self.unet_modules: list[LLLiteModule] = []
        for name, linear, depth in lllite_targets(unet, rename):
            module = LLLiteModule(name, linear, depth, cond_emb_dim, mlp_dim, dropout, multiplier)
            self.add_module(name, module)
            self.unet_modules.append(module)
        if not self.unet_modules:
            raise ConfigError("ControlNet-LLLite: the model has no SDXL transformer block to attach to "
                              "(expected an SDXL UNet)")
        logger.info("ControlNet-LLLite: %d modules (cond_emb_dim %d, mlp_dim %d)", len(self.unet_modules),
                    cond_emb_dim, mlp_dim)

    # --- the network interface the loop and tools call (sd-scripts' names) -------------------------
    def set_cond_image(self, cond_image: Optional[torch.Tensor]) -> None:
        """The conditioning images of the next forward passes: (b, 3, H, W) in [-1, 1], H and W the images'."""
        for module in self.unet_modules:
            module.set_cond_image(cond_image)

    def adapters(self) -> list[LLLiteModule]:
        return self.unet_modules

    def is_mergeable(self) -> bool:
        return False

    def prepare_optimizer_params(self, text_encoder_lr: Any, unet_lr: Optional[float],
                                 default_lr: Optional[float]) -> tuple[list[dict], list[str]]:
        """One group: every LLLite weight at --unet_lr (else the base rate)."""
        self.requires_grad_(True)
        lr = unet_lr if unet_lr is not None else default_lr
        return ([{"params": list(self.parameters()), "lr": lr}], ["lllite"]) if lr else ([], [])

    def load_weights(self, file: Union[str, os.PathLike, Mapping[str, torch.Tensor]]) -> Any:
        """Load a LLLite file (or state dict); every tensor must fit this network by name and shape."""
        source = os.fspath(file) if isinstance(file, (str, os.PathLike)) else "the weights"
        weights = load_state_dict(source) if isinstance(file, (str, os.PathLike)) else dict(file)
        own = self.state_dict()
        unexpected = sorted(set(weights) - set(own))
        missing = sorted(set(own) - set(weights))
        if unexpected or missing:
            which = f"{unexpected[0]} is not in this network" if unexpected else f"{missing[0]} is missing"
            raise UserError(f"--network_weights {source}: not a ControlNet-LLLite file for this model "
                            f"({len(unexpected)} unexpected, {len(missing)} missing tensors; e.g. {which})")
        for key, value in weights.items():
            if own[key].shape != value.shape:
                raise UserError(f"--network_weights {source}: {key} has shape {list(value.shape)} in the file but "
                                f"{list(own[key].shape)} here; use the file's --cond_emb_dim and --network_dim")
        return self.load_state_dict(weights, strict=True)

    def saved_metadata(self, metadata: dict[str, str]) -> dict[str, str]:
        """sd-scripts' naming: modelspec.architecture gets "/control-net-lllite"."""
        arch = metadata.get("modelspec.architecture")
        if arch and not arch.endswith(ARCHITECTURE_SUFFIX):
            metadata["modelspec.architecture"] = arch + ARCHITECTURE_SUFFIX
        return metadata


def unet_rename(lora_targets: Optional[list]) -> Optional[Callable[[str], str]]:
    """The diffusers -> SGM rename of the UNet's LoRA target (prefix "lora_unet"), if the caller gave targets."""
    for target in lora_targets or ():
        if target.prefix == "lora_unet" and not target.is_text_encoder:
            return target.rename
    return None


def _int_arg(kwargs: dict, key: str) -> Optional[int]:
    value = kwargs.get(key)
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--network_args {key}={value}: expected a positive even integer") from None
    if number < 2 or number % 2:
        raise ConfigError(f"--network_args {key}={value}: expected a positive even integer (the embedding's first "
                          "layer has half as many channels)")
    return number


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae: Any,
                   text_encoder: Any, unet: Any, neuron_dropout: Optional[float] = None,
                   lora_targets: Optional[list] = None, **kwargs: Any) -> ControlNetLLLite:
    """A new LLLite network: `network_dim` is the MLP width (sd-scripts' --network_dim), `cond_emb_dim` comes in
    `kwargs` (sd-scripts' --cond_emb_dim); `network_alpha` has no meaning here."""
    cond_emb_dim = _int_arg(kwargs, "cond_emb_dim")
    if cond_emb_dim is None:
        raise ConfigError("--cond_emb_dim: required for ControlNet-LLLite (sd-scripts' examples use 32)")
    unknown = sorted(set(kwargs) - {"cond_emb_dim"})
    if unknown:
        raise ConfigError(f"--network_args {unknown[0]}: not an argument of ControlNet-LLLite (it takes none but "
                          "cond_emb_dim)")
    return ControlNetLLLite(unet, cond_emb_dim, int(network_dim or 16), neuron_dropout or None, multiplier,
                            rename=unet_rename(lora_targets))


def create_network_from_weights(multiplier: float, file: Optional[str], vae: Any, text_encoder: Any, unet: Any,
                                weights_sd: Optional[dict] = None, for_inference: bool = False,
                                lora_targets: Optional[list] = None, **kwargs: Any
                                ) -> tuple[ControlNetLLLite, dict]:
    """A network shaped like a saved file (cond_emb_dim and mlp_dim read from its tensors)."""
    if weights_sd is None:
        weights_sd = load_state_dict(file)
    first = next((k for k in weights_sd if k.endswith(".down.0.weight")), None)
    if first is None:
        raise UserError(f"{file or 'the weights'}: not a ControlNet-LLLite file (no *.down.0.weight tensor)")
    name = first[: -len(".down.0.weight")]
    mlp_dim = weights_sd[first].shape[0]
    cond_emb_dim = weights_sd[f"{name}.conditioning1.0.weight"].shape[0] * 2
    network = ControlNetLLLite(unet, cond_emb_dim, mlp_dim, None, multiplier, rename=unet_rename(lora_targets))
    for module in network.unet_modules:
        if f"{module.lllite_name}.down.0.weight" in weights_sd:
            saved = depth_of_weights(weights_sd, module.lllite_name)
            if saved != module.depth:
                raise UserError(f"{file or 'the weights'}: {module.lllite_name} has depth {saved} in the file but "
                                f"{module.depth} in this model")
    if for_inference:
        network.eval()
    return network, weights_sd
