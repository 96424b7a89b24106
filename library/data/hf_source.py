"""A Hugging Face `datasets` dataset on disk as the images and captions of a subset (`dataset_name`).

`dataset_name` names a local dataset (never the hub): a folder written by `save_to_disk` (a Dataset, or a
DatasetDict from which `dataset_split` is taken), a `.parquet` / `.arrow` file, a folder of parquet or
arrow files, or an "imagefolder" folder (images + metadata.jsonl/csv). Each row is one sample:
`image_column` (an Image feature, or a path string relative to the dataset) and `caption_column`.

Rows whose image is a local file (imagefolder) use that file, as a folder subset would. Rows that embed
the image bytes (save_to_disk, parquet) are written once, unchanged, to
`<cache>/datasets/<fingerprint>/<row:08d>.<ext>`, so that the image scan, buckets, loading and the
latent disk cache (`<row>_<W>x<H>_<arch>.npz` beside it) work as for folders and are named stably by
the dataset's fingerprint and the row index. Nothing here raises on bad data: every problem is one line.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any, Optional

from PIL import Image

from library.core.io_utils import atomic_path
from library.data.config import SubsetConfig
from library.data.discovery import DiscoveredImage, SubsetImages
from library.data.images import IMAGE_EXTENSIONS

logger = logging.getLogger(__name__)

_FORMAT_EXT = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "BMP": ".bmp"}


def cache_root() -> str:
    """The toolkit's cache folder (LORA_TOOLKIT_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache, /lora-toolkit)."""
    return os.environ.get("LORA_TOOLKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lora-toolkit")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _files_with(folder: str, ext: str) -> bool:
    return any(n.lower().endswith(ext) for n in os.listdir(folder))


def _builder_cache_dir() -> Optional[str]:
    """Where load_dataset keeps its arrow files: $HF_DATASETS_CACHE when set, else inside the toolkit's cache."""
    return None if os.environ.get("HF_DATASETS_CACHE") else os.path.join(cache_root(), "datasets", "hf-cache")


def load_local_dataset(sub: SubsetConfig) -> tuple[Any, Optional[str]]:
    """(datasets.Dataset, None) or (None, one-line problem). Never touches the hub."""
    where, path, split = f"{sub.where}.dataset_name", sub.dataset_name or "", sub.dataset_split
    cache = _builder_cache_dir()
    try:
        import datasets
    except ImportError:
        return None, f"{where}: reading a dataset needs the `datasets` package (pip install datasets)"
    if not os.path.exists(path):
        return None, f"{where}: not found: {path}"
    try:
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_dict.json")):
            dd = datasets.load_from_disk(path)
            if split not in dd:
                return None, (f"{sub.where}.dataset_split: no split {split!r} in {path} "
                              f"(splits: {', '.join(sorted(dd.keys()))})")
            return dd[split], None
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "state.json")):
            return datasets.load_from_disk(path), None
        if os.path.isfile(path):
            ext = os.path.splitext(path)[1].lower()
            if ext == ".arrow":
                return datasets.Dataset.from_file(path), None
            if ext == ".parquet":
                return datasets.load_dataset("parquet", data_files={split: path}, split=split, cache_dir=cache), None
            return None, f"{where}: expected a .parquet or .arrow file or a dataset folder, got {path}"
        for builder, ext in (("parquet", ".parquet"), ("arrow", ".arrow")):
            if _files_with(path, ext):
                return datasets.load_dataset(builder, data_dir=path, split=split, cache_dir=cache), None
        return datasets.load_dataset("imagefolder", data_dir=path, split=split, cache_dir=cache), None
    except Exception as exc:  # the datasets library raises many kinds (ValueError, FileNotFoundError, ...)
        return None, f"{where}: cannot load {path} (split {split!r}): {_first_line(exc)}"


def _check_columns(sub: SubsetConfig, ds: Any) -> list[str]:
    columns = list(ds.column_names)
    out = []
    for key, name in (("image_column", sub.image_column), ("caption_column", sub.caption_column)):
        if name not in columns:
            out.append(f"{sub.where}.{key}: no column {name!r} in {sub.dataset_name} (columns: {', '.join(columns)})")
    return out


def _image_ext(data: bytes, name: Optional[str]) -> Optional[str]:
    ext = os.path.splitext(name or "")[1].lower()
    if ext in IMAGE_EXTENSIONS:
        return ext
    try:
        with Image.open(io.BytesIO(data)) as img:
            return _FORMAT_EXT.get(img.format or "", ".png" if img.format else None)
    except Exception:
        return None


def _decode_problem(data: bytes) -> Optional[str]:
    """Why the bytes are not a decodable image, or None."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
        return None
    except Image.UnidentifiedImageError:
        return "not a recognised image format"
    except Exception as exc:
        return f"cannot decode image: {_first_line(exc)}"


def _row_image(value: Any, base_dir: str) -> tuple[Optional[bytes], Optional[str]]:
    """(bytes, path) of one image cell: an undecoded Image feature {bytes, path}, raw bytes or a path string."""
    if isinstance(value, dict):
        return value.get("bytes"), value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    if isinstance(value, str):
        return None, value if os.path.isabs(value) else os.path.join(base_dir, value)
    return None, None


def _store(folder: str, row: int, data: bytes, name: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """The cached file of a row's image bytes (written once, checked for decoding then), or a problem."""
    ext = _image_ext(data, name)
    if ext is None:
        return None, "not a recognised image format"
    target = os.path.join(folder, f"{row:08d}{ext}")
    if os.path.isfile(target) and os.path.getsize(target) == len(data):
        return target, None
    problem = _decode_problem(data)
    if problem:
        return None, problem
    os.makedirs(folder, exist_ok=True)
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return target, None


def discover_dataset_subset(sub: SubsetConfig) -> SubsetImages:
    """The rows of a `dataset_name` subset as images (files) with raw captions; every problem one line."""
    result = SubsetImages()
    ds, problem = load_local_dataset(sub)
    if problem:
        result.problems.append(problem)
        return result
    column_problems = _check_columns(sub, ds)
    if column_problems:
        result.problems.extend(column_problems)
        return result
    import datasets

    fingerprint = ds._fingerprint  # the loaded dataset's own (stable for the same files); taken before any cast
    feature = ds.features[sub.image_column]
    if isinstance(feature, datasets.Image):
        ds = ds.cast_column(sub.image_column, datasets.Image(decode=False))
    elif not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "binary", "large_binary")):
        result.problems.append(f"{sub.where}.image_column: column {sub.image_column!r} of {sub.dataset_name} "
                               f"holds {type(feature).__name__}, not images (an Image feature, bytes or paths)")
        return result
    base_dir = sub.dataset_name if os.path.isdir(sub.dataset_name) else os.path.dirname(sub.dataset_name)
    folder = os.path.join(cache_root(), "datasets", fingerprint)
    label = f"{sub.dataset_name} row"
    rows = ds.select_columns([sub.image_column, sub.caption_column])
    for i, row in enumerate(rows):
        data, path = _row_image(row[sub.image_column], base_dir)
        if data:
            path, why = _store(folder, i, data, path)
        elif path and os.path.isfile(path):
            why = None
        else:
            why = f"image file not found: {path}" if path else "no image"
        if why:
            result.problems.append(f"{label} {i}: {why}")
            continue
        caption = row[sub.caption_column]
        if caption is not None and not isinstance(caption, str):
            result.problems.append(f"{label} {i}: caption column {sub.caption_column!r} holds "
                                   f"{type(caption).__name__}, not text")
            continue
        caption = "\n".join(line.strip() for line in (caption or "").strip().splitlines() if line.strip())
        if not caption:
            result.missing_captions += 1
            caption = sub.class_tokens or ""
        result.images.append(DiscoveredImage(path, caption))
    if not result.images and not result.problems:
        result.problems.append(f"{sub.where}: no rows in {sub.dataset_name} (split {sub.dataset_split!r})")
    return result
