"""The folders the API may show and the settings may name (datasets): each path must resolve, after
symlinks, inside one of the allowed roots (--data_root; default: the toolkit's folder and the current one)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from webui.jobfiles import IMAGE_EXTENSIONS, REPO_ROOT

DATASET_PATH_KEYS = ("image_dir", "conditioning_data_dir", "metadata_file")


class Roots:
    def __init__(self, roots: Sequence[str]):
        self.roots = []
        for root in roots:
            real = os.path.realpath(root)
            if real not in self.roots:
                self.roots.append(real)

    def inside(self, path: str, base: str = REPO_ROOT) -> Optional[str]:
        """`path` (relative ones from `base`, where runs start) resolved, or None when outside every root."""
        real = os.path.realpath(os.path.join(base, os.path.expanduser(path)))
        for root in self.roots:
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return real
        return None

    def listing(self, path: Optional[str], thumbnails: int = 8) -> dict[str, Any]:
        """The subfolders of `path` with their image counts, its own image count and first images; without
        a path, the roots. Raises PermissionError outside the roots, FileNotFoundError for no such folder."""
        if not path:
            return {"path": None, "parent": None, "images": 0, "thumbnails": [],
                    "folders": [{"name": r, "path": r, "images": count_images(r)} for r in self.roots]}
        real = self.inside(path)
        if real is None:
            raise PermissionError(path)
        if not os.path.isdir(real):
            raise FileNotFoundError(path)
        folders = []
        for entry in sorted(os.scandir(real), key=lambda e: e.name.lower()):
            if entry.is_dir() and not entry.name.startswith(".") and self.inside(entry.path) is not None:
                folders.append({"name": entry.name, "path": entry.path, "images": count_images(entry.path)})
        images = image_files(real)
        parent = os.path.dirname(real)
        return {"path": real, "parent": parent if self.inside(parent) is not None and parent != real else None,
                "images": len(images), "thumbnails": images[:thumbnails], "folders": folders}


def image_files(folder: str) -> list[str]:
    try:
        return sorted(e.path for e in os.scandir(folder) if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))
    except OSError:
        return []


def count_images(folder: str) -> int:
    return len(image_files(folder))


def dataset_paths(dataset: dict) -> list[tuple[str, str]]:
    """(key, value) of every path a dataset TOML names (subset keys at any level)."""
    out = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in DATASET_PATH_KEYS and isinstance(value, str):
                    out.append((key, value))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dataset)
    return out


def missing_dataset_folders(dataset: dict, base: str = REPO_ROOT) -> list[tuple[str, str, str]]:
    """(key, path, table) of each folder or file a [[datasets.subsets]] names that does not exist, e.g.
    ("image_dir", "data/cats", "datasets[0].subsets[1]"); relative paths are from `base`, where runs start."""
    out = []
    datasets = dataset.get("datasets") if isinstance(dataset, dict) else None
    for di, ds in enumerate(datasets if isinstance(datasets, list) else []):
        subsets = ds.get("subsets") if isinstance(ds, dict) else None
        for si, sub in enumerate(subsets if isinstance(subsets, list) else []):
            if not isinstance(sub, dict):
                continue
            for key in DATASET_PATH_KEYS:
                value = sub.get(key)
                if not isinstance(value, str) or not value:
                    continue
                path = os.path.join(base, os.path.expanduser(value))
                if not (os.path.isfile(path) if key == "metadata_file" else os.path.isdir(path)):
                    out.append((key, value, f"datasets[{di}].subsets[{si}]"))
    return out
