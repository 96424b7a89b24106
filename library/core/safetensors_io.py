"""Writing tensors to `.safetensors` and torch-pickle files, with an optional cast to a save dtype.

One entry point per file format, each atomic (temporary file beside the target, renamed on success,
through library.core.io_utils):

* `write_safetensors(tensors, path, metadata, dtype, mem_eff)`: `mem_eff=False` hands a prepared copy
  of every tensor (cast, on the CPU: a second copy of the model in memory) to safetensors' `save_file`,
  which writes them from that memory (through io_utils.save_safetensors_atomic's own temporary);
  `mem_eff=True` (sd-scripts' `--mem_eff_save`) writes the header, then each tensor's bytes one at a
  time (cast, moved to the CPU and dropped before the next), so at most one converted tensor exists
  besides the model. Both give the same tensors (names, dtypes, shapes, bytes).
* `write_torch_pickle(obj_with_tensors, path)`: `torch.save` (`.ckpt`, `pytorch_model.bin`).

Only floating-point tensors are cast; integer and bool tensors keep their dtype, in both writers.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from library.core.io_utils import atomic_path, save_safetensors_atomic

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_ALIGN = 8  # the data section starts at a multiple of 8 bytes, as safetensors writes it


class Deferred:
    """A tensor made only when it is written (a fused or derived tensor of a file layout), so that a layout's
    state dict holds no copy of the model; it tells its shape and dtype without being made."""

    def __init__(self, make: Callable[[], torch.Tensor], shape: Sequence[int], dtype: torch.dtype):
        self.make, self.shape, self.dtype = make, torch.Size(shape), dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def concat(tensors: Sequence[torch.Tensor]) -> Deferred:
    """torch.cat(tensors, dim=0), made when written."""
    parts = list(tensors)
    shape = (sum(t.shape[0] for t in parts), *parts[0].shape[1:])
    return Deferred(lambda: torch.cat(parts, dim=0), shape, parts[0].dtype)


TensorLike = Union[torch.Tensor, Deferred]


def materialized(tensor: TensorLike) -> torch.Tensor:
    return tensor.make() if isinstance(tensor, Deferred) else tensor


def prepared(tensor: TensorLike, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`tensor` as written: made (Deferred), cast to `dtype` (floating-point tensors only), detached,
    contiguous, on the CPU."""
    t = materialized(tensor).detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t.cpu().contiguous()


def write_safetensors(tensors: Mapping[str, TensorLike], path: str, metadata: Optional[Mapping[str, str]] = None,
                      dtype: Optional[torch.dtype] = None, mem_eff: bool = False) -> str:
    """Write `tensors` (cast to `dtype` where floating) to a `.safetensors` file at `path`, atomically."""
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    if not mem_eff:
        save_safetensors_atomic({k: prepared(v, dtype) for k, v in tensors.items()}, path, meta)
        return path
    with atomic_path(path) as tmp:
        _stream(tensors, tmp, meta, dtype)
    return path


def _out_dtype(tensor: TensorLike, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _stream(tensors: Mapping[str, TensorLike], path: str, metadata: Optional[dict[str, str]],
            dtype: Optional[torch.dtype]) -> None:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, t in tensors.items():
        out = _out_dtype(t, dtype)
        size = t.numel() * torch.empty((), dtype=out).element_size()
        header[key] = {"dtype": _DTYPE_NAMES[out], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(prepared(t, dtype).reshape(-1).view(torch.uint8).numpy().data)


def write_torch_pickle(obj: Any, path: str) -> str:
    """`torch.save(obj)` to `path`, atomically (the tensors in `obj` already prepared by the caller)."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return path
