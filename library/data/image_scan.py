"""Read image sizes and decode-check every image, in parallel, with a metadata cache so a second scan is near-instant.

Each file is decoded once, every byte of it (JPEGs at 1/8 scale, which reads and checks the same
data with 64x less memory; Pillow releases the GIL while decoding, so a thread pool spreads the
work over the cores), so a truncated or corrupt image is found before training instead of
being skipped mid-run. The EXIF orientation is applied to the reported size, so the size here is
the size load_image() returns. The cache is a JSON file keyed by absolute path; an entry (a size
or the problem found) is reused only while the file's modification time (ns) and byte size are
unchanged, so a re-run decodes only new or changed files.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from PIL import Image

from library.core.io_utils import atomic_write_text
from library.data.folders import broken_link_reason
from library.data.images import exif_orientation, oriented_size

CACHE_VERSION = 2  # 2: every entry was decode-checked, not only its header read
PROGRESS_MIN_FILES = 300  # below this a progress bar is only noise
_MAX_WORKERS = 16  # reads wait on I/O and decoding releases the GIL, so more threads than cores pay off


@dataclass
class ScanResult:
    """Sizes (width, height) of readable images and a one-line problem for each unreadable one."""

    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    from_cache: int = 0  # how many answers came from the metadata cache


@dataclass
class _Entry:
    mtime_ns: int
    size: int
    width: int = 0
    height: int = 0
    problem: Optional[str] = None

    def to_json(self) -> dict:
        data = {"mtime_ns": self.mtime_ns, "size": self.size}
        if self.problem is None:
            data.update(width=self.width, height=self.height)
        else:
            data["problem"] = self.problem
        return data


def read_image_size(path: str, decode: bool = False) -> tuple[int, int]:
    """(width, height) as displayed (EXIF rotation applied), from the header; with `decode`, every pixel is
    decoded too (then a truncated or corrupt file raises here).

    Raises OSError / ValueError / Image.UnidentifiedImageError when the header cannot be read.
    """
    with Image.open(path) as img:
        width, height = img.size
        size = oriented_size(width, height, exif_orientation(img))
        if decode:
            try:
                if img.format == "JPEG":  # decode at 1/8 scale: every byte is still read and checked, 64x less memory
                    img.draft(None, (max(1, width // 8), max(1, height // 8)))
                img.load()
            except Exception as exc:  # decoders raise OSError, SyntaxError, ValueError, zlib errors...
                raise _DecodeFailed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        return size


class _DecodeFailed(Exception):
    """The header reads but the pixels do not decode (truncated or corrupt data)."""


def _probe(path: str) -> tuple[str, Optional[os.stat_result], Optional[str]]:
    """stat() one file; returns (path, stat or None, problem or None)."""
    try:
        return path, os.stat(path), None
    except OSError as exc:
        link = broken_link_reason(path)
        if link:
            return path, None, link
        if isinstance(exc, FileNotFoundError):
            return path, None, "file not found"
        return path, None, f"cannot stat file: {exc.strerror or exc}"


def _scan_one(path: str, st: os.stat_result) -> _Entry:
    entry = _Entry(mtime_ns=st.st_mtime_ns, size=st.st_size)
    if st.st_size == 0:
        entry.problem = "empty file (0 bytes)"
        return entry
    try:
        entry.width, entry.height = read_image_size(path, decode=True)
    except _DecodeFailed as exc:
        entry.problem = f"cannot decode image: {exc}"
    except Image.UnidentifiedImageError:
        entry.problem = "not a recognised image format (unreadable header)"
    except Exception as exc:  # header parsers raise OSError, SyntaxError, ValueError, struct.error...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        entry.problem = f"unreadable image header: {reason}"
    else:
        if entry.width < 1 or entry.height < 1:
            entry.problem = f"image has no pixels ({entry.width}x{entry.height})"
    return entry


def _load_cache(cache_path: Optional[str]) -> dict[str, dict]:
    """Entries of an existing cache file; a missing, corrupt or old-version file is just an empty cache."""
    if not cache_path or not os.path.exists(cache_path):
        return {}
    try:
        with open(cache_path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _cached_entry(raw: object, st: os.stat_result) -> Optional[_Entry]:
    """The cached answer for a file when its mtime and size still match, else None."""
    if not isinstance(raw, dict):
        return None
    if raw.get("mtime_ns") != st.st_mtime_ns or raw.get("size") != st.st_size:
        return None
    if isinstance(raw.get("problem"), str):
        return _Entry(st.st_mtime_ns, st.st_size, problem=raw["problem"])
    width, height = raw.get("width"), raw.get("height")
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        return None
    return _Entry(st.st_mtime_ns, st.st_size, width, height)


def _map_parallel(fn, items: list, workers: int, progress: bool, desc: str) -> list:
    """fn over items on a thread pool, in order, with a tqdm bar (and ETA) for long runs."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(fn, items)
        if progress and len(items) >= PROGRESS_MIN_FILES:
            from tqdm import tqdm

            results = tqdm(results, total=len(items), desc=desc, unit="img")
        return list(results)


def scan_image_sizes(
    paths: list[str],
    cache_path: Optional[str],
    progress: bool = True,
    max_workers: Optional[int] = None,
) -> ScanResult:
    """Sizes of many images, each decode-checked, reusing and updating the metadata cache at `cache_path`.

    Result keys are the paths exactly as given. Every file is stat()ed; only new
    or changed files (different mtime or size) are opened and decoded. The cache file is
    rewritten atomically when anything changed; entries for files not in
    `paths` are kept, so one cache can serve several datasets.
    """
    workers = max_workers or min(_MAX_WORKERS, (os.cpu_count() or 1) * 4)
    result = ScanResult()
    cached = _load_cache(cache_path)
    unique_paths = list(dict.fromkeys(paths))  # a path listed twice is read once
    probes = [_probe(path) for path in unique_paths]  # stat() is cheap; a thread pool only adds overhead

    entries: dict[str, _Entry] = {}
    to_scan: list[tuple[str, os.stat_result]] = []
    for path, st, problem in probes:
        if st is None:
            result.problems[path] = problem
            continue
        hit = _cached_entry(cached.get(os.path.abspath(path)), st)
        if hit is None:
            to_scan.append((path, st))
        else:
            entries[path] = hit
            result.from_cache += 1

    scanned = _map_parallel(lambda item: _scan_one(*item), to_scan, workers, progress, "checking images")
    for (path, _), entry in zip(to_scan, scanned):
        entries[path] = entry

    for path in unique_paths:
        entry = entries.get(path)
        if entry is None:
            continue
        if entry.problem is None:
            result.sizes[path] = (entry.width, entry.height)
        else:
            result.problems[path] = entry.problem

    if cache_path and to_scan:
        for path, _ in to_scan:
            cached[os.path.abspath(path)] = entries[path].to_json()
        text = json.dumps({"version": CACHE_VERSION, "entries": cached}, separators=(",", ":"))
        atomic_write_text(cache_path, text)
    return result
