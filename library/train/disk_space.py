"""Disk space: checked before training against what one save needs, and a full disk during a save named.

A save is atomic (temporary name, then rename), so a full disk never leaves a half-written file;
what is left to do is to say so in one line: the path, the space needed, the space free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Iterator

import torch

from library.core.errors import UserError

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


class DiskFull(UserError):
    """The disk filled up during a save; the files saved before are intact."""


@contextlib.contextmanager
def naming_a_full_disk(path: str, needed: int) -> Iterator[None]:
    """Turn ENOSPC (and EDQUOT) while writing `path` into one line naming the path and the space needed."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        folder = os.path.dirname(os.path.abspath(path))
        raise DiskFull(f"{path}: the disk is full ({free_bytes(folder) / MiB:.0f} MiB free, this save needs "
                       f"about {needed / MiB:.0f} MiB); nothing was half-written and the files saved before "
                       "are intact; free some space and resume with --resume auto") from None
