"""Writing a whole model in the formats of sd-scripts' `--save_model_as`, for every family.

A family says what to write (`ModelFamily.single_file_state_dict`: the original single-file layout;
`ModelFamily.pipeline_folder`: the parts and model_index.json of its diffusers pipeline); this module
writes it, one code path per format:

* `safetensors`: library.core.safetensors_io.write_safetensors (header metadata; `mem_eff` streams).
* `ckpt`: `torch.save({"state_dict": ..., "epoch": ..., "global_step": ...})` as sd-scripts writes it
  (no metadata).
* `diffusers` / `diffusers_safetensors`: a pipeline folder; every model part as `config.json` plus
  `diffusion_pytorch_model.bin` / `pytorch_model.bin` (torch pickle, sd-scripts' `safe_serialization=False`)
  or `diffusion_pytorch_model.safetensors` / `model.safetensors` (`True`); tokenizers and the scheduler
  through their own `save_pretrained`. The metadata is not written into folders.

The state dicts handed in hold the model's own tensors under new names (only fused or derived tensors
are new), so no second copy of the model is made before writing; the cast to `dtype` happens per
tensor as it is written, and the live model is never changed.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from library.core.errors import UserError
from library.core.io_utils import atomic_directory
from library.core.safetensors_io import prepared, write_safetensors, write_torch_pickle

SINGLE_FILE_FORMATS = ("ckpt", "safetensors")
FOLDER_FORMATS = ("diffusers", "diffusers_safetensors")
SAFETENSORS_METADATA = {"format": "pt"}  # what transformers / diffusers write into their weight files


def check_save_format(fmt: str, allowed: tuple[str, ...], family: str = "", path: str = "") -> str:
    """`fmt` if it is one of `allowed`; a one-line UserError otherwise."""
    if fmt not in allowed:
        where = f"{path}: " if path else ""
        who = f"a {family} model" if family else "a model"
        raise UserError(f"{where}cannot save {who} as {fmt} (--save_model_as takes {', '.join(allowed)})")
    return fmt


def format_of_path(path: str) -> str:
    """The format a path names: `.safetensors` / `.ckpt` files, anything else a diffusers folder."""
    lower = path.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith(".ckpt"):
        return "ckpt"
    return "diffusers_safetensors"


def write_single_file(state: Mapping[str, Any], path: str, fmt: str, dtype: Optional[torch.dtype] = None,
                      metadata: Optional[Mapping[str, str]] = None, mem_eff: bool = False, *, epoch: int = 0,
                      global_step: int = 0) -> str:
    """A `.safetensors` file (with `metadata` in its header) or a `.ckpt` pickle of `state` (with epoch and step)."""
    if fmt == "safetensors":
        return write_safetensors(state, path, metadata, dtype, mem_eff)
    checkpoint = {"state_dict": {k: prepared(v, dtype) for k, v in state.items()},
                  "epoch": int(epoch), "global_step": int(global_step)}
    return write_torch_pickle(checkpoint, path)


def _without_tied(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a tensor that is the same storage as an earlier one (tied weights: transformers keeps the first)."""
    seen: set[tuple] = set()
    out = {}
    for key, t in state.items():
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and ident in seen:
            continue
        seen.add(ident)
        out[key] = t
    return out


def _write_config(module: nn.Module, folder: str, dtype: Optional[torch.dtype]) -> str:
    """config.json as the part's own save_pretrained writes it; the stem of its weight file."""
    if hasattr(module, "save_config"):  # diffusers ModelMixin
        module.save_config(folder)
        return "diffusion_pytorch_model"
    config = copy.deepcopy(module.config)  # transformers PreTrainedModel
    config.architectures = [type(module).__name__]
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
    config.dtype = dtype or (floats[0] if floats else torch.float32)
    config.save_pretrained(folder)
    return "pytorch_model"


def write_model_folder(module: nn.Module, folder: str, safe: bool, dtype: Optional[torch.dtype] = None,
                       mem_eff: bool = False) -> None:
    """One model part as `from_pretrained` reads it: config.json plus its weights file."""
    os.makedirs(folder, exist_ok=True)
    stem = _write_config(module, folder, dtype)
    state = _without_tied(module.state_dict())
    if safe:
        name = "model.safetensors" if stem == "pytorch_model" else f"{stem}.safetensors"
        write_safetensors(state, os.path.join(folder, name), SAFETENSORS_METADATA, dtype, mem_eff)
    else:
        write_torch_pickle({k: prepared(v, dtype) for k, v in state.items()}, os.path.join(folder, f"{stem}.bin"))


def _directory_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def write_pipeline_folder(parts: Mapping[str, Any], model_index: Mapping[str, Any], out_dir: str, safe: bool = True,
                          dtype: Optional[torch.dtype] = None, mem_eff: bool = False) -> str:
    """A diffusers pipeline folder, atomically: each part in its subfolder, then model_index.json.

    Modules are written by write_model_folder; tokenizers and schedulers by their own save_pretrained.
    The folder is built beside `out_dir` and renamed into place (an existing one is replaced).
    """
    import json

    with atomic_directory(out_dir) as tmp:
        os.chmod(tmp, _directory_mode())  # mkdtemp makes it 0700; a saved model folder follows the umask
        for sub, part in parts.items():
            if isinstance(part, nn.Module):
                write_model_folder(part, os.path.join(tmp, sub), safe, dtype, mem_eff)
            else:
                part.save_pretrained(os.path.join(tmp, sub))
        with open(os.path.join(tmp, "model_index.json"), "w", encoding="utf-8") as f:
            json.dump(dict(model_index), f, indent=2)
    return out_dir
