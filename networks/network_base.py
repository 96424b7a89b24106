"""What every `--network_module` network shares: sd-scripts' network interface, and its files.

The loop and the tools call a network by sd-scripts' method names. `AdapterNetwork` answers the ones that are
the same for every kind of adapter (LoRA, DyLoRA, OFT, ControlNet-LLLite):

- `set_multiplier`, `apply_to`, `restore` act on each module of `adapters()`: each holds its own `multiplier`
  and hooks itself into (or out of) the layer it adapts;
- `prepare_grad_etc`, `on_epoch_start`, `on_step_start`, `get_trainable_params`, `enable_gradient_checkpointing`
  (the adapters run inside the model's blocks, so they are checkpointed with them and hold nothing of their own);
- `save_weights`: the network's `state_dict()` (its file layout), cast to the save precision, written atomically
  by `library.core.metadata.save_lora_state_dict` (.safetensors with metadata and hashes, else a torch pickle).

`load_state_dict(file)`, the module-level function sd-scripts' network modules have, reads such a file back, with
a one-line error for a missing or damaged one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from library.core.metadata import save_lora_state_dict
from networks.lora_files import read_state_dict


def load_state_dict(file: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    """Tensors of an adapter file (.safetensors, or a torch pickle of tensors)."""
    return read_state_dict(os.fspath(file))[0]


class AdapterNetwork(nn.Module):
    """sd-scripts' network interface over the adapter modules a subclass lists in `adapters()`."""

    multiplier: float = 1.0

    def adapters(self) -> Sequence[nn.Module]:
        """The adapter modules, each with `multiplier`, `apply_to()` and `restore()`."""
        raise NotImplementedError

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = multiplier
        for module in self.adapters():
            module.multiplier = multiplier

    def apply_to(self, text_encoder: Any = None, unet: Any = None, apply_text_encoder: bool = True,
                 apply_unet: bool = True) -> None:
        for module in self.adapters():
            module.apply_to()

    def restore(self) -> None:
        for module in self.adapters():
            module.restore()

    def prepare_grad_etc(self, text_encoder: Any = None, unet: Any = None) -> None:
        self.requires_grad_(True)

    def on_epoch_start(self, text_encoder: Any = None, unet: Any = None) -> None:
        self.train()

    def on_step_start(self) -> None:
        pass

    def get_trainable_params(self) -> Iterable[nn.Parameter]:
        return self.parameters()

    def enable_gradient_checkpointing(self) -> None:
        pass  # the adapters run inside the model's (checkpointed) blocks

    def saved_metadata(self, metadata: dict[str, str]) -> dict[str, str]:
        """The metadata written with the file (a network may mark its kind in it)."""
        return metadata

    def save_weights(self, file: str, dtype: Optional[torch.dtype], metadata: Optional[dict[str, str]]) -> None:
        """Write the network's file atomically, in `dtype` (else each tensor's own)."""
        state = {k: v.detach().to("cpu", dtype or v.dtype).clone() for k, v in self.state_dict().items()}
        save_lora_state_dict(file, state, self.saved_metadata(dict(metadata or {})))
