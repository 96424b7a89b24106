"""Fine-tune metadata (`--in_json`): sd-scripts' `{image key: {"caption", "tags", "train_resolution"}}` JSON.

One implementation for both sides: the trainer's reader (discovery.discover_finetune) and the
`finetune/` tools that write, merge and clean the file.

Image keys, as sd-scripts' finetune scripts write them:
- default: the image path relative to train_data_dir without its extension (for a flat folder this
  is the file stem, exactly sd-scripts' key); the trainer finds the image as
  `<image_dir>/<key><image extension>`.
- `--full_path`: the absolute path of the image, extension included (sd-scripts writes the path as
  globbed; absolute here so the file works from any working directory).

Cleaning (`clean_tags`, `clean_caption`) follows sd-scripts' finetune/clean_captions_and_tags.py rule
for rule; docs/finetune_tools.md lists the rules.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Iterable, Optional

from library.core.errors import DataError, UserError
from library.core.io_utils import atomic_write_text
from library.data.folders import is_image_path
from library.data.images import IMAGE_EXTENSIONS

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- reading (trainer + tools)
def read_metadata_entries(path: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """(image key, entry) pairs of a metadata .json ({key: {...}}) or .jsonl ({"image_path": ...} per line),
    and the problems found (one line each); never raises."""
    if not os.path.isfile(path):
        return [], [f"{path}: metadata file not found"]
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return [], [f"{path}: cannot read metadata file: {e}"]
    if path.lower().endswith(".jsonl"):
        entries, problems = [], []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as e:
                problems.append(f"{path}: line {n}: not valid JSON ({e.msg})")
                continue
            if not isinstance(item, dict) or not isinstance(item.get("image_path"), str):
                problems.append(f"{path}: line {n}: expected an object with \"image_path\"")
                continue
            entries.append((item["image_path"], item))
        return entries, problems
    try:
        data = json.loads(text)
    except ValueError as e:
        return [], [f"{path}: not valid JSON (line {e.lineno}: {e.msg})"]
    if not isinstance(data, dict):
        return [], [f"{path}: expected a JSON object {{image: {{caption, tags}}}}"]
    bad = [f"{path}: {key}: expected an object with caption/tags" for key, v in data.items() if not isinstance(v, dict)]
    return [(k, v) for k, v in data.items() if isinstance(v, dict)], bad


def resolve_image(key: str, image_dir: Optional[str]) -> Optional[str]:
    """The image file of a metadata key: the key itself, or `<image_dir>/<key>`, with or without an image extension."""
    candidates = [key] if os.path.isabs(key) or not image_dir else [os.path.join(image_dir, key), key]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
        for ext in IMAGE_EXTENSIONS:
            if os.path.isfile(candidate + ext):
                return candidate + ext
    return None


def load_metadata(path: str) -> dict[str, dict]:
    """The metadata as a dict {key: entry} for the tools; a .jsonl file is keyed by image_path.

    Raises DataError listing every problem (missing file, bad JSON, entries that are not objects).
    """
    entries, problems = read_metadata_entries(path)
    if problems:
        raise DataError("\n".join(problems))
    out: dict[str, dict] = {}
    for key, entry in entries:
        out[key] = {k: v for k, v in entry.items() if k != "image_path"} if path.lower().endswith(".jsonl") else entry
    return out


def save_metadata(path: str, metadata: dict[str, dict]) -> None:
    """Write the metadata JSON atomically, laid out as sd-scripts writes it (json.dumps, indent 2)."""
    atomic_write_text(path, json.dumps(metadata, indent=2))


def load_or_new(out_json: str, in_json: Optional[str]) -> dict[str, dict]:
    """sd-scripts' merge rule: read --in_json, else an existing out_json, else start empty."""
    if in_json is None and os.path.isfile(out_json):
        in_json = out_json
    if in_json is None:
        logger.info("new metadata will be created: %s", out_json)
        return {}
    logger.info("loading existing metadata: %s", in_json)
    return load_metadata(in_json)


# --------------------------------------------------------------------------- images and keys
def list_dataset_images(train_data_dir: str, recursive: bool = False) -> list[str]:
    """Image files of train_data_dir (and its subfolders with `recursive`), sorted; hidden names skipped."""
    if not os.path.isdir(train_data_dir):
        raise UserError(f"train_data_dir: folder not found: {train_data_dir}")
    found = []
    for folder, dirs, files in os.walk(train_data_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(folder, n) for n in files if is_image_path(n) and not n.startswith("."))
        if not recursive:
            break
    return sorted(found)


def image_key(image_path: str, train_data_dir: str, full_path: bool) -> str:
    """The metadata key of an image (see the module docstring)."""
    if full_path:
        return os.path.abspath(image_path)
    rel = os.path.relpath(image_path, train_data_dir)
    return os.path.splitext(rel)[0].replace(os.sep, "/")


def check_unique_keys(images: Iterable[str], train_data_dir: str, full_path: bool) -> None:
    """Two images whose keys coincide (a.png and a.jpg) would share an entry: refuse, naming them."""
    seen: dict[str, str] = {}
    clashes = []
    for path in images:
        key = image_key(path, train_data_dir, full_path)
        if key in seen:
            clashes.append(f"{seen[key]} and {path} have the same metadata key {key!r} (rename one, or use --full_path)")
        seen[key] = path
    if clashes:
        raise DataError("\n".join(clashes))


def read_text_file(image_path: str, extension: str) -> Optional[str]:
    """The stripped text of `<image path without extension><extension>` (sd-scripts' rule), or None if absent."""
    path = os.path.splitext(image_path)[0] + extension
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read().strip()
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None


def merge_text_files(metadata: dict[str, dict], images: list[str], train_data_dir: str, field: str,
                     extension: str, full_path: bool, progress=None) -> tuple[int, list[str]]:
    """Set metadata[key][field] from each image's text file (overwriting, as sd-scripts).

    Returns (entries written, images without a text file or with an empty one); those are skipped.
    """
    written, missing = 0, []
    for path in progress(images) if progress else images:
        text = read_text_file(path, extension)
        if not text:
            missing.append(path)
            continue
        metadata.setdefault(image_key(path, train_data_dir, full_path), {})[field] = text
        written += 1
    return written, missing


# --------------------------------------------------------------------------- cleaning (sd-scripts' rules)
_HAIR_LENGTH = re.compile(r", (long|short|medium) hair, ")
_HAIR_CUT = re.compile(r", (bob|hime) cut, ")
_HAIR = re.compile(r", ([\w\-]+) hair, ")
_WORD = re.compile(r", ([\w\-]+|hair ornament), ")
# With several people in the picture, these tags describe different people: drop them when one repeats.
_REMOVE_IN_MULTI = [
    _HAIR_LENGTH,
    _HAIR_CUT,
    re.compile(r", [\w\-]+ eyes, "),
    re.compile(r", ([\w\-]+ sleeves|sleeveless), "),
    re.compile(r", (ponytail|braid|ahoge|twintails|[\w\-]+ bun|single hair bun|single side bun|two side up|two tails"
               r"|[\w\-]+ braid|sidelocks), "),
]

# Applied in this order, each repeated until the caption no longer changes.
CAPTION_REPLACEMENTS: list[tuple[str, str]] = [
    ("anime anime", "anime"),
    ("young ", ""),
    ("anime girl", "girl"),
    ("cartoon female", "girl"),
    ("cartoon lady", "girl"),
    ("cartoon character", "girl"),
    ("cartoon woman", "girl"),
    ("cartoon women", "girls"),
    ("cartoon girl", "girl"),
    ("anime female", "girl"),
    ("anime lady", "girl"),
    ("anime character", "girl"),
    ("anime woman", "girl"),
    ("anime women", "girls"),
    ("lady", "girl"),
    ("female", "girl"),
    ("woman", "girl"),
    ("women", "girls"),
    ("people", "girls"),
    ("person", "girl"),
    ("a cartoon figure", "a figure"),
    ("a cartoon image", "an image"),
    ("a cartoon picture", "a picture"),
    ("an anime cartoon image", "an image"),
    ("a cartoon anime drawing", "a drawing"),
    ("a cartoon drawing", "a drawing"),
    ("girl girl", "girl"),
]


def clean_tags(tags: str) -> str:
    """sd-scripts' tag cleaning (finetune/clean_captions_and_tags.py), same output for the same input:

    1. "_" -> " " (the emoticon "^_^" is kept).
    2. DeepDanbooru ratings: everything from the first ", rating" on is dropped.
    3. With "girls" or "boys" among the tags: a hair length, hair cut, "* eyes", sleeves or hair style
       tag that occurs more than once is removed (all occurrences); "* hair" colour tags too when
       several remain (hair length tags are kept).
    4. A one-word tag (or "hair ornament") is dropped when a longer tag ends with it
       ("shirt" beside "white shirt").
    """
    tags = tags.replace("^_^", "^@@@^").replace("_", " ").replace("^@@@^", "^_^")
    tokens = tags.split(", rating")
    if len(tokens) > 1:
        tags = tokens[0]
    # Each tag framed by ", " on both sides, separators doubled so neighbouring tags never share one.
    tags = ", " + tags.replace(", ", ", , ") + ", "
    if "girls" in tags or "boys" in tags:
        for pattern in _REMOVE_IN_MULTI:
            if len(pattern.findall(tags)) > 1:
                tags = pattern.sub("", tags)
        hair_length = _HAIR_LENGTH.search(tags)
        if hair_length:
            kept = hair_length.group()
            tags = _HAIR_LENGTH.sub(", @@@, ", tags)
        if len(_HAIR.findall(tags)) > 1:
            tags = _HAIR.sub("", tags)
        if hair_length:
            tags = tags.replace(", @@@, ", kept)
    for word in _WORD.findall(tags):
        if re.search(f", ((\\w+) )+{word}, ", tags):
            tags = tags.replace(f", {word}, ", "")
    tags = tags.replace(", , ", ", ")
    return tags[2:-2]


def clean_caption(caption: str) -> str:
    """sd-scripts' caption cleaning: CAPTION_REPLACEMENTS in order, each until nothing changes."""
    for old, new in CAPTION_REPLACEMENTS:
        while old in caption:
            replaced = caption.replace(old, new)
            if replaced == caption:
                break
            caption = replaced
    return caption


def clean_metadata(metadata: dict[str, dict]) -> tuple[list[str], list[str], list[tuple[str, str, str]]]:
    """Clean every entry's tags and caption in place.

    Returns (keys without tags, keys without caption, [(key, before, after)] of every changed text).
    """
    no_tags, no_caption, changes = [], [], []
    for key, entry in metadata.items():
        for field, fn, missing in (("tags", clean_tags, no_tags), ("caption", clean_caption, no_caption)):
            value = entry.get(field)
            if not isinstance(value, str):
                missing.append(key)
                continue
            cleaned = fn(value)
            if cleaned != value:
                changes.append((key, value, cleaned))
            entry[field] = cleaned
    return no_tags, no_caption, changes
