"""WD14 tagger logic without the model: sd-scripts' `selected_tags.csv`, image preprocessing and tag selection.

The model call is the tool's (finetune/tag_images_by_wd14_tagger.py: onnxruntime); everything here is
plain numpy so it is tested without weights.

- `selected_tags.csv`: header `tag_id,name,category,count`; category 9 = rating, 0 = general,
  4 = character. The model outputs one probability per row in file order: the 4 ratings, then the
  general tags, then the character tags.
- Preprocessing (as sd-scripts): RGB -> BGR, pad to a square with white (centred), resize to the
  model's input size (area average to shrink, lanczos to enlarge), float32 in 0..255, (H, W, 3).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from library.core.errors import DataError
from library.data.images import resize_image


@dataclass
class TagLabels:
    rating: list[str]
    general: list[str]
    character: list[str]


def read_selected_tags(path: str) -> TagLabels:
    """The labels of a WD14 `selected_tags.csv`; DataError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise DataError(f"{path}: cannot read the tag list: {e.strerror or e}") from None
    if not rows or rows[0][:3] != ["tag_id", "name", "category"]:
        raise DataError(f"{path}: expected a WD14 selected_tags.csv with header tag_id,name,category,count")
    body = [r for r in rows[1:] if len(r) >= 3]
    return TagLabels(rating=[r[1] for r in body if r[2] == "9"], general=[r[1] for r in body if r[2] == "0"],
                     character=[r[1] for r in body if r[2] == "4"])


def preprocess(image_rgb: np.ndarray, size: int) -> np.ndarray:
    """(H, W, 3) uint8 RGB -> (size, size, 3) float32 BGR, padded square with white (see module docstring)."""
    h, w = image_rgb.shape[:2]
    side = max(h, w)
    top, left = (side - h) // 2, (side - w) // 2
    square = np.full((side, side, 3), 255, dtype=np.uint8)
    square[top:top + h, left:left + w] = image_rgb[:, :, :3]
    square = resize_image(square, (size, size))
    return np.ascontiguousarray(square[:, :, ::-1]).astype(np.float32)


@dataclass
class TagOptions:
    """The selection flags of sd-scripts' tagger (see docs/finetune_tools.md)."""

    general_threshold: float = 0.35
    character_threshold: float = 0.35
    remove_underscore: bool = False
    undesired_tags: frozenset = frozenset()
    character_tags_first: bool = False
    use_rating_tags: bool = False
    use_rating_tags_as_last_tag: bool = False
    always_first_tags: Optional[list[str]] = None
    character_tag_expand: bool = False
    caption_separator: str = ", "
    tag_replacement: Optional[str] = None


def _replacements(spec: str) -> list[tuple[str, str]]:
    """`source,target;source2,target2` with `\\,` and `\\;` escaping a comma or semicolon in a tag."""
    out = []
    for part in spec.replace("\\,", "\0c").replace("\\;", "\0s").split(";"):
        pair = part.split(",")
        if len(pair) != 2:
            raise DataError(f"--tag_replacement: expected source,target pairs separated by ';', got {spec!r}")
        out.append(tuple(t.replace("\0c", ",").replace("\0s", ";") for t in pair))
    return out


def prepare_labels(labels: TagLabels, opts: TagOptions) -> TagLabels:
    """The label names as written: character expansion, underscores, replacements (sd-scripts' order)."""
    rating, general, character = list(labels.rating), list(labels.general), list(labels.character)
    if opts.character_tag_expand:
        for i, tag in enumerate(character):
            if tag.endswith(")"):  # name_(series) -> name, series
                parts = tag.split("(")
                name = "(".join(parts[:-1])
                name = name[:-1] if name.endswith("_") else name
                character[i] = name + opts.caption_separator + parts[-1].replace(")", "")
    if opts.remove_underscore:  # short tags (emoticons such as ^_^) keep theirs
        rating, general, character = ([t.replace("_", " ") if len(t) > 3 else t for t in names]
                                      for names in (rating, general, character))
    for source, target in _replacements(opts.tag_replacement) if opts.tag_replacement else []:
        for names in (general, character, rating):
            if source in names:
                names[names.index(source)] = target
                break
    return TagLabels(rating, general, character)


def select_tags(probs: Sequence[float], labels: TagLabels, opts: TagOptions) -> list[str]:
    """The tags of one image from its output row: general tags >= general_threshold and character tags >=
    character_threshold in label order (undesired ones left out), optional rating (argmax of the 4 first)."""
    probs = np.asarray(probs, dtype=np.float32)
    n_rating, n_general = 4, len(labels.general)
    tags: list[str] = []
    for i, p in enumerate(probs[n_rating:]):
        if i < n_general:
            if p >= opts.general_threshold and labels.general[i] not in opts.undesired_tags:
                tags.append(labels.general[i])
        elif i - n_general < len(labels.character) and p >= opts.character_threshold:
            name = labels.character[i - n_general]
            if name not in opts.undesired_tags:
                tags.insert(0, name) if opts.character_tags_first else tags.append(name)
    if (opts.use_rating_tags or opts.use_rating_tags_as_last_tag) and labels.rating:
        rating = labels.rating[int(np.argmax(probs[:n_rating]))]
        if rating not in opts.undesired_tags:
            tags.insert(0, rating) if opts.use_rating_tags else tags.append(rating)
    for tag in opts.always_first_tags or []:
        if tag in tags:
            tags.remove(tag)
            tags.insert(0, tag)
    return tags


def merge_with_existing(existing: str, tags: list[str], separator: str) -> list[str]:
    """--append_tags: the tags already in a file, then the new ones it does not have."""
    old = [t.strip() for t in existing.strip("\n").split(separator.strip()) if t.strip()]
    return old + [t for t in tags if t not in old]


@dataclass
class TagFrequency:
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, tags: list[str]) -> None:
        for tag in tags:
            self.counts[tag] = self.counts.get(tag, 0) + 1

    def most_common(self) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: -kv[1])
