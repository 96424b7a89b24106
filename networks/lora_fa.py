"""`--network_module networks.lora_fa`: LoRA-FA (arXiv 2308.03303) as sd-scripts' networks/lora_fa.py trains it.

The project's LoRA (networks.lora: the family's targets and kohya names, every --network_args) with
`lora_down` drawn from N(0, 2 / (in + rank)) and frozen: only `lora_up` trains. The file layout is exactly
networks.lora's (`lora_down.weight`, `lora_up.weight`, `alpha`), so every tool and loader takes it; files
record `ss_network_module` = networks.lora_fa, as sd-scripts' do.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch import nn

from networks import lora
from networks.lora import LoRANetwork, load_state_dict  # noqa: F401  (load_state_dict: the loaders' API)


class LoRAFANetwork(LoRANetwork):
    """A LoRANetwork whose lora_down weights never train."""

    def requires_grad_(self, requires_grad: bool = True) -> "LoRAFANetwork":
        super().requires_grad_(requires_grad)
        for module in self.text_encoder_loras + self.unet_loras:
            module.lora_down.requires_grad_(False)
        return self

    def prepare_optimizer_params(self, text_encoder_lr: Any, unet_lr: Optional[float],
                                 default_lr: Optional[float]) -> tuple[list[dict], list[str]]:
        groups, names = super().prepare_optimizer_params(text_encoder_lr, unet_lr, default_lr)
        self.requires_grad_(True)
        kept = [({**g, "params": [p for p in g["params"] if p.requires_grad]}, n) for g, n in zip(groups, names)]
        kept = [(g, n) for g, n in kept if g["params"]]
        return [g for g, _ in kept], [n for _, n in kept]

    def get_trainable_params(self) -> Iterable[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def _init_down(network: LoRAFANetwork) -> LoRAFANetwork:
    """The paper's init of A: normal with std sqrt(2 / (in + rank)); up stays zero."""
    with torch.no_grad():
        for module in network.text_encoder_loras + network.unet_loras:
            down = module.lora_down.weight
            fan_in = down.shape[1]  # in_features, or in_channels of a conv
            nn.init.normal_(down, std=math.sqrt(2.0 / (fan_in + down.shape[0])))
    return network.requires_grad_(True)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae: Any,
                   text_encoder: Any, unet: Any, neuron_dropout: Optional[float] = None, **kwargs: Any
                   ) -> LoRAFANetwork:
    network = lora.create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout,
                                  **kwargs)
    network.__class__ = LoRAFANetwork  # same modules and state; only what trains differs
    return _init_down(network)


def create_network_from_weights(multiplier: float, file: Optional[str], vae: Any, text_encoder: Any, unet: Any,
                                weights_sd: Optional[dict] = None, for_inference: bool = False, **kwargs: Any):
    network, weights = lora.create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd,
                                                        for_inference, **kwargs)
    network.__class__ = LoRAFANetwork
    return network.requires_grad_(True), weights
