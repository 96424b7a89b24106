"""Disk space: checked before training against what one save needs, and a full disk during a save named.

A save is atomic (temporary name, then rename), so a full disk never leaves a half-written file;
what is left to do is to say so in one line: the path, the space needed, the space free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

import torch

from library.core.errors import UserError
from library.core.io_utils import write_failure

MiB = 2**20


def tensor_bytes(tensors, dtype: torch.dtype | None = None) -> int:
    """Bytes of `tensors` written at `dtype` (None: as they are)."""
    size = 0
    for t in tensors:
        itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None and t.is_floating_point() \
            else t.element_size()
        size += t.numel() * itemsize
    return size


def free_bytes(folder: str) -> int:
    return shutil.disk_usage(folder).free


def check_free_space(folder: str, needed: int, what: str) -> None:
    """UserError before any training when `folder` has less free space than `needed` bytes."""
    free = free_bytes(folder)
    if free < needed:
        raise UserError(f"--output_dir {folder}: {free / MiB:.0f} MiB free, but {what} needs about "
                        f"{needed / MiB:.0f} MiB; free some space or choose another folder")


class SaveFailed(UserError):
    """A save could not be written (an I/O error); the files saved before are intact."""


class DiskFull(SaveFailed):
    """The disk filled up during a save; the files saved before are intact."""


@contextlib.contextmanager
def naming_a_full_disk(path: str, needed: int) -> Iterator[None]:
    """Turn a failed write of `path` into one line: a full disk (ENOSPC / EDQUOT, however the writer reports it:
    OSError, safetensors' SafetensorError, torch.save's RuntimeError) names the path and the space needed;
    another write failure names its cause. The writers are atomic, so nothing was half-written."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        yield
    except Exception as e:
        failure = write_failure(e, folder)
        if failure is None:
            raise
        disk_full, reason = failure
        if disk_full:
            raise DiskFull(f"{path}: the disk is full ({free_bytes(folder) / MiB:.0f} MiB free, this save needs "
                           f"about {needed / MiB:.0f} MiB); nothing was half-written and the files saved before "
                           "are intact; free some space and resume with --resume auto") from None
        raise SaveFailed(f"{path}: could not be written ({reason}); nothing was half-written and the files saved "
                         "before are intact; resume with --resume auto once it can be written") from None
