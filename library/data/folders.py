"""Image folders on disk: which files are images, and sd-scripts' `N_name` repeat folders."""

from __future__ import annotations

import errno
import os
import re
from typing import Optional

from library.data.images import IMAGE_EXTENSIONS

REPEAT_FOLDER = re.compile(r"^(\d+)_(.*)$")


def is_image_path(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS


def broken_link_reason(path: str) -> Optional[str]:
    """Why a symbolic link cannot be followed (a loop, or a target that does not exist), or None when `path`
    is not a link or the link works."""
    if not os.path.islink(path):
        return None
    try:
        os.stat(path)
    except OSError as e:
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        if e.errno == errno.ELOOP:
            return f"symbolic link loop ({os.path.basename(path)} -> {target} never reaches a file)"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"dangling symbolic link (its target {target} does not exist)"
        return f"cannot follow symbolic link to {target}: {e.strerror or e}"
    return None


def broken_links(folder: str, wanted=is_image_path) -> dict[str, str]:
    """The entries of `folder` (names accepted by `wanted`) that are symbolic links which cannot be followed,
    with the reason: list_images and find_repeat_folders would otherwise drop them without a word."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if wanted(name):
            reason = broken_link_reason(path)
            if reason:
                out[path] = reason
    return out


def list_images(folder: str) -> list[str]:
    """Image files directly inside `folder`, sorted by name (so splits and orders are reproducible)."""
    names = sorted(n for n in os.listdir(folder) if is_image_path(n) and os.path.isfile(os.path.join(folder, n)))
    return [os.path.join(folder, n) for n in names]


def find_repeat_folders(folder: str, flag: str) -> tuple[list[tuple[str, int, str]], list[str]]:
    """The `N_name` subfolders of `folder` as (path, repeats N, class tokens "name"), and problems.

    Folders without the numeric prefix are skipped (as sd-scripts); when none qualifies the
    problem says so.
    """
    if not os.path.isdir(folder):
        return [], [f"{flag}: no images found in {folder}: the folder does not exist"]
    found, skipped = [], []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        match = REPEAT_FOLDER.match(name)
        if not match or int(match.group(1)) < 1:
            skipped.append(name)
            continue
        found.append((path, int(match.group(1)), match.group(2)))
    if found:
        return found, []
    why = "no subfolders named like 10_name (N_ prefix = repeats)"
    if skipped:
        why += f"; skipped: {', '.join(skipped[:5])}" + (" ..." if len(skipped) > 5 else "")
    elif any(is_image_path(n) for n in os.listdir(folder)):
        why += "; the images must be inside N_name subfolders, not directly in this folder"
    return [], [f"{flag}: no images found in {folder}: {why}"]

