"""A model built without allocating its weights, checked against the tensors that will become them."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from library.families.base import ModelLoadError


def empty_model_for(label: str, path: str, factory: Callable[[], torch.nn.Module],
                    state_dict: Mapping[str, torch.Tensor],
                    shape_of: Callable[[torch.Tensor], tuple] = lambda t: tuple(t.shape),
                    ) -> tuple[torch.nn.Module, dict[str, torch.Size]]:
    """(`factory()` on the meta device, its state-dict shapes). Every key must be in `state_dict` with that shape
    (`shape_of`: a quantized tensor's logical shape), else a one-line ModelLoadError naming `label` and `path`."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = factory()
    wanted = {k: v.shape for k, v in model.state_dict().items()}
    missing = [k for k in wanted if k not in state_dict]
    if missing:
        raise ModelLoadError(f"{label} {path}: incomplete, no tensor for {missing[0]} ({len(missing)} missing)")
    wrong = next((k for k, s in wanted.items() if shape_of(state_dict[k]) != tuple(s)), None)
    if wrong is not None:
        raise ModelLoadError(f"{label} {path}: {wrong} has shape {shape_of(state_dict[wrong])}, "
                             f"expected {tuple(wanted[wrong])} for the shapes of the rest of the file")
    return model, wanted
