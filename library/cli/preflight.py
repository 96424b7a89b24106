"""Checks run once every flag is parsed and before anything heavy loads (the dataset scan, the model).

Today: the folders the run writes into (--output_dir, --logging_dir) exist or can be created, and a file
can be written there. A run that would fail on its first save fails here instead, in one line naming the flag.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from library.core.errors import ConfigError
from library.train.settings import TrainingOptions


def _missing_parents(path: str) -> list[str]:
    """`path` and those of its parents that do not exist yet, outermost first."""
    missing = []
    current = os.path.abspath(path)
    while not os.path.exists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return missing[::-1]


def check_writable_dir(flag: str, path: Optional[str]) -> None:
    """Check that `path` is, or can be made, a folder a file can be written to: create it if needed, probe-write
    a temporary file, then remove the file and any folder created here (a run that stops before it starts
    leaves nothing behind; the trainer creates the folder when it starts).

    Raises a one-line ConfigError naming `flag` and `path` when it is a file, cannot be created or is
    not writable (read-only mount, permissions, a pseudo file system such as /proc).
    """
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a file, not a folder; choose a folder path")
    created = _missing_parents(path)
    try:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot create the folder: {e.strerror or e}") from None
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"{flag} {path}: the folder is not writable: {e.strerror or e}") from None
    finally:
        for folder in reversed(created):
            try:
                os.rmdir(folder)
            except OSError:
                break


def check_output_folders(training: TrainingOptions) -> None:
    """--output_dir and --logging_dir must be writable folders (or folders that can be created)."""
    check_writable_dir("--output_dir", training.output_dir)
    check_writable_dir("--logging_dir", training.logging_dir)
