"""Hashes written into LoRA metadata (sshs_*) and used for base-model metadata.

- `model_hash`: sha256 of the tensor-data section of a safetensors serialization
  that carries only the `ss_*` metadata (what A1111 and sd-scripts compute).
- `legacy_hash`: first 8 hex digits of sha256 over 0x10000 bytes at 0x100000.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Mapping, Optional

import torch
from safetensors.torch import save as safetensors_save

from library.core.tensors import unshared


def _tensor_data_section(blob: bytes) -> bytes:
    header_len = struct.unpack("<Q", blob[:8])[0]
    return blob[8 + header_len:]


def _ss_only(metadata: Optional[Mapping[str, str]]) -> dict[str, str]:
    return {k: v for k, v in (metadata or {}).items() if k.startswith("ss_")}


def model_hash(state_dict: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> str:
    """sshs_model_hash: sha256 of the serialized tensor data of `state_dict`."""
    blob = safetensors_save(unshared(state_dict), metadata=_ss_only(metadata))
    return hashlib.sha256(_tensor_data_section(blob)).hexdigest()


def legacy_hash_of_bytes(blob: bytes) -> str:
    """sshs_legacy_hash / ss_sd_model_hash recipe on an in-memory file."""
    m = hashlib.sha256()
    m.update(blob[0x100000:0x100000 + 0x10000])
    return m.hexdigest()[0:8]


def legacy_hash(state_dict: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> str:
    blob = safetensors_save(unshared(state_dict), metadata=_ss_only(metadata))
    return legacy_hash_of_bytes(blob)


def sshs_hashes(state_dict: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """(sshs_model_hash, sshs_legacy_hash) computed from one serialization."""
    blob = safetensors_save(unshared(state_dict), metadata=_ss_only(metadata))
    return hashlib.sha256(_tensor_data_section(blob)).hexdigest(), legacy_hash_of_bytes(blob)


def file_legacy_hash(path: str) -> str:
    """ss_sd_model_hash of a model file; "" for a folder (diffusers layout)."""
    if not os.path.isfile(path):
        return ""
    with open(path, "rb") as f:
        f.seek(0x100000)
        return hashlib.sha256(f.read(0x10000)).hexdigest()[0:8]


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    """ss_new_sd_model_hash: full sha256 of a model file; "" for a folder."""
    if not os.path.isfile(path):
        return ""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
