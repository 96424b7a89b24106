"""Atomic writes: nothing the toolkit writes is ever half-written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_path(final_path: str) -> Iterator[str]:
    """Yield a temporary path beside `final_path`; rename onto it only if the block succeeds."""
    directory = os.path.dirname(os.path.abspath(final_path)) or "."
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(final_path)
    # Keep the extension: some writers (np.savez, save_weights) decide the format by it.
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-", suffix=os.path.splitext(base)[1], dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, final_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(final_dir: str) -> Iterator[str]:
    """Yield a temporary folder beside `final_dir`; when the block succeeds it replaces `final_dir`.

    Temporary names start with "." so globs for finished folders never see them.
    """
    final_dir = os.path.abspath(final_dir)
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        if os.path.exists(final_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.old.", dir=parent)
            os.replace(final_dir, os.path.join(old, "previous"))
            os.replace(tmp, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def save_safetensors_atomic(tensors: dict, path: str, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
