"""Hashes written into LoRA metadata (sshs_*) and used for base-model metadata.

- `model_hash`: sha256 of the tensor-data section of a safetensors serialization
  that carries only the `ss_*` metadata (what A1111 and sd-scripts compute).
- `legacy_hash`: first 8 hex digits of sha256 over 0x10000 bytes at 0x100000.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from typing import Mapping, Optional

import torch
from safetensors.torch import save as safetensors_save

from library.core.io_utils import atomic_write_text
from library.core.tensors import unshared

logger = logging.getLogger(__name__)


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


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def weights_sha256(state: "Mapping[str, torch.Tensor] | torch.nn.Module") -> str:
    """sha256 over every tensor of a module's state dict (or a state dict): name, dtype, shape and bytes.

    What the weights hold, wherever they were loaded from (a single file, a diffusers folder, an
    in-memory preset): two models give the same hash exactly when every tensor is equal. Fast enough to
    run once per run on a VAE (about 0.2 s for SDXL's 84M float32 parameters).
    """
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            continue
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel() and t.device.type != "meta":
            h.update(_tensor_bytes(t))
    return h.hexdigest()


# --- model-file hashes, cached by path + mtime + size ---------------------------------------------------
_FILE_HASHES: dict[str, tuple[str, str]] = {}
_FILE_HASHES_LOCK = threading.Lock()
FILE_HASH_CACHE_NAME = "file_hashes.json"


def forget_file_hashes() -> None:
    """Drop the in-process cache of `cached_file_hashes` (as in a new process; the JSON cache stays)."""
    with _FILE_HASHES_LOCK:
        _FILE_HASHES.clear()


def file_hash_cache_path() -> str:
    """The JSON file that remembers model-file hashes between runs (LORA_TOOLKIT_CACHE_DIR moves it)."""
    root = os.environ.get("LORA_TOOLKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lora-toolkit")
    return os.path.join(root, FILE_HASH_CACHE_NAME)


def _file_key(path: str) -> Optional[str]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.path.realpath(path)}|{st.st_mtime_ns}|{st.st_size}"


def _read_hash_cache(cache: str) -> dict:
    try:
        with open(cache, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_file_hashes(path: str) -> tuple[str, str]:
    """(ss_sd_model_hash, ss_new_sd_model_hash) of a model file: sd-scripts' legacy hash (sha256 of 64 KiB at
    1 MiB, 8 hex digits) and the full sha256.

    A multi-GB checkpoint is read once: the result is kept per process and in `file_hash_cache_path()`,
    keyed by the file's real path, modification time (ns) and size, so a file changed in place is hashed
    again. Raises OSError if the file cannot be read.
    """
    key = _file_key(path)
    if key is not None:
        with _FILE_HASHES_LOCK:
            if key in _FILE_HASHES:
                return _FILE_HASHES[key]
        cache = file_hash_cache_path()
        entry = _read_hash_cache(cache).get(key)
        if isinstance(entry, dict) and isinstance(entry.get("legacy"), str) and isinstance(entry.get("sha256"), str):
            result = (entry["legacy"], entry["sha256"])
            with _FILE_HASHES_LOCK:
                _FILE_HASHES[key] = result
            return result
    result = (file_legacy_hash(path), file_sha256(path))
    if key is None or _file_key(path) != key:  # changed while we read it: do not remember
        return result
    with _FILE_HASHES_LOCK:
        _FILE_HASHES[key] = result
    try:
        cache = file_hash_cache_path()
        data = _read_hash_cache(cache)
        data[key] = {"legacy": result[0], "sha256": result[1]}
        atomic_write_text(cache, json.dumps(data, indent=0, sort_keys=True))
    except OSError as e:  # a read-only home: the hash is still right, only not remembered
        logger.debug("could not write the file-hash cache: %s", e)
    return result
