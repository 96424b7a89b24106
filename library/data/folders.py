"""Image folders on disk: which files are images, and sd-scripts' `N_name` repeat folders."""

from __future__ import annotations

import os
import re

from library.data.images import IMAGE_EXTENSIONS

REPEAT_FOLDER = re.compile(r"^(\d+)_(.*)$")


def is_image_path(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS


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

