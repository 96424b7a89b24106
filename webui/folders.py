"""The folders the API may show and the settings may name: each path must resolve, after symlinks, inside
one of the allowed roots (--data_root; default: the toolkit's folder and the current one) or, for what a run
writes or reads of its own, inside the job's folder. A setting that is part of a file name must be a name."""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Optional, Sequence

from webui.jobfiles import IMAGE_EXTENSIONS, REPO_ROOT

DATASET_PATH_KEYS = ("image_dir", "conditioning_data_dir", "control_directory", "metadata_file")
# config.toml keys (in any section) by what the run does with their value. The UI's own keys (output_dir,
# logging_dir, dataset_config, sample_prompts, config_file: jobfiles.MANAGED_KEYS) point into the job's folder.
NAME_KEYS = ("output_name", "log_prefix", "log_tracker_name")  # joined to output_dir / logging_dir: names only
JOB_FOLDER_KEYS = ("profiler_trace_dir", "console_log_file", "debug_dataset_dir")  # what the run writes: inside the job's folder
# Files and folders the run reads, or writes beside the user's data (latent caches, DeepSpeed's NVMe swap):
# inside the roots or the job's folder.
READ_PATH_KEYS = (
    "pretrained_model_name_or_path", "vae", "ae", "clip_l", "clip_g", "t5xxl", "qwen3", "mistral3", "gemma2",
    "text_encoder", "byt5", "llm_adapter_path", "t5_tokenizer_path", "tokenizer_cache_dir", "network_weights",
    "base_weights",
    "resume", "log_tracker_config", "noise_scheduler_overrides", "train_data_dir", "reg_data_dir", "in_json",
    "conditioning_data_dir", "offload_optimizer_nvme_path", "offload_param_nvme_path", "metadata_thumbnail",
    "embeddings", "weights", "controlnet_model_name_or_path")
MODEL_ID_KEYS = ("pretrained_model_name_or_path", "t5_tokenizer_path")  # may name a preset or a hub id instead
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the trainer's loader tells one


class Roots:
    def __init__(self, roots: Sequence[str]):
        self.roots = []
        for root in roots:
            real = os.path.realpath(root)
            if real not in self.roots:
                self.roots.append(real)

    def add(self, root: str) -> str:
        """Allow one more folder (after symlinks); returns it."""
        real = os.path.realpath(root)
        if real not in self.roots:
            self.roots.append(real)
        return real

    def remove(self, root: str) -> None:
        real = os.path.realpath(root)
        if real in self.roots:
            self.roots.remove(real)

    def inside(self, path: str, base: str = REPO_ROOT) -> Optional[str]:
        """`path` (relative ones from `base`, where runs start) resolved, or None when outside every root.
        A path with a NUL character is outside (callers that answer a request refuse it first, with 400)."""
        if "\0" in path:
            return None
        real = resolved(path, base)
        for root in self.roots:
            if within(real, root):
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


def count_images(folder: str, limit: int = 1_000_000) -> int:
    """The images in `folder` and its subfolders (hidden ones and symbolic links to folders are not entered)."""
    total = 0
    for _here, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        total += sum(1 for f in files if f.lower().endswith(IMAGE_EXTENSIONS))
        if total >= limit:
            break
    return total


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


def resolved(path: str, base: str = REPO_ROOT) -> str:
    """`path` after `~`, from `base` when relative (runs start in the toolkit's folder), after symlinks."""
    return os.path.realpath(os.path.join(base, os.path.expanduser(path)))


def within(real: str, folder: str) -> bool:
    """Whether the resolved path `real` is `folder` or inside it (`folder` resolved too)."""
    folder = os.path.realpath(folder)
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def config_values(config: Any, keys: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """(key, value) of every `keys` entry in config.toml's tables at any depth (the trainer flattens them);
    a list value (base_weights) gives one entry per item."""
    if not isinstance(config, dict):
        return
    for key, value in config.items():
        if isinstance(value, dict):
            yield from config_values(value, keys)
        elif key in keys:
            for item in value if isinstance(value, list) else [value]:
                yield key, item


def is_model_id(value: str) -> bool:
    """A built-in preset (tiny:sd1) or a Hugging Face id (owner/name) that is no path here: not a path."""
    if value.startswith(("tiny:", "random:")):
        return True
    return bool(_HUB_ID.match(value)) and ".." not in value.split("/") and not os.path.exists(
        os.path.join(REPO_ROOT, value))


def settings_path_refusal(settings: dict, job_folder: str, roots: Roots) -> Optional[tuple[int, str, str]]:
    """(HTTP status, one-line error, field) for the first setting that names a place a run may not read or
    write: a NUL in a path or name (422), a name with a folder part or `..` (422), a folder the run writes
    into outside the job's folder (403), a file or folder it reads outside the roots and the job's folder
    (403), a dataset path outside the roots (403). None when every path-valued setting is contained."""
    config, dataset = settings.get("config") or {}, settings.get("dataset") or {}
    for key, value in config_values(config, NAME_KEYS):
        if not isinstance(value, str):
            continue
        if "\0" in value or "/" in value or "\\" in value or value.strip() in (".", ".."):
            return 422, (f"{key} {value!r}: expected a name, not a path (no '/', '\\', '..' or NUL): the run's "
                         "files go into the job's folder"), key
    candidates = [(key, value, "job") for key, value in config_values(config, JOB_FOLDER_KEYS)]
    candidates += [(key, value, "read") for key, value in config_values(config, READ_PATH_KEYS)]
    candidates += [(key, value, "dataset") for key, value in dataset_paths(dataset)]
    for key, value, kind in candidates:
        if not isinstance(value, str) or value == "":
            continue
        if "\0" in value:
            return 422, f"{key} {value!r}: a path cannot contain a NUL character", key
        if kind == "job":
            if not within(resolved(value), job_folder):
                return 403, (f"{key} {value}: outside the job's folder ({job_folder}): the run writes only "
                             "there"), key
        elif kind == "read":
            if (key == "resume" and value == "auto") or (key in MODEL_ID_KEYS and is_model_id(value)) \
                    or (key == "metadata_thumbnail" and value.startswith("data:")):  # an image given inline
                continue
            if roots.inside(value) is None and not within(resolved(value), job_folder):
                return 403, (f"{key} {value}: outside the allowed folders ({', '.join(roots.roots)}; the "
                             f"server's --data_root) and the job's folder"), key
        elif roots.inside(value) is None and not within(resolved(value), job_folder):
            return 403, (f"{key} {value}: outside the allowed folders ({', '.join(roots.roots)}; the server's "
                         "--data_root) and the job's folder"), key
    return None
