"""Find the images of each subset and their raw captions (and masks).

Nothing here raises on bad data: every problem becomes one line in a list, so
the user sees all of them at once before training starts.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from library.data.config import SubsetConfig
from library.data.control_images import attach_controls
from library.data.finetune_metadata import read_metadata_entries, resolve_image
from library.data.folders import REPEAT_FOLDER, broken_links, list_images
from library.data.images import IMAGE_EXTENSIONS

# `name_cx_cy_w_h`: the face-crop suffix sd-scripts strips when looking for a caption file.
_FACE_SUFFIX = re.compile(r"^(.*?)(_\d+){4}$")


@dataclass
class DiscoveredImage:
    path: str
    caption: str  # raw caption (all lines kept; the pipeline picks one)
    mask_path: Optional[str] = None
    # The control scripts' conditioning image (conditioning_data_dir, same stem): RGB, cropped with the image.
    conditioning_path: Optional[str] = None
    # A fine-tune metadata entry's "train_resolution" (width, height): the bucket prepare_buckets_latents chose.
    train_resolution: Optional[tuple[int, int]] = None
    control_paths: tuple[str, ...] = ()  # edit training: control_directory's images of this one (control_images.py)


@dataclass
class SubsetImages:
    """The images of one subset, the problems found, and how many fell back to class tokens / ""."""

    images: list[DiscoveredImage] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing_captions: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # image files left out (broken symbolic links), with why


def _no_images_reason(folder: str) -> str:
    files = [n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n))]
    dirs = [n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n))]
    why = f"no files with extensions {', '.join(IMAGE_EXTENSIONS)}"
    if files:
        why += f" ({len(files)} other files)"
    if any(REPEAT_FOLDER.match(d) for d in dirs):
        why += "; it has N_name subfolders: point image_dir at each of them"
    return why


def caption_candidates(image_path: str, caption_extension: str) -> list[str]:
    """`<stem><ext>`, then the stem without a `_cx_cy_w_h` face suffix."""
    stem = os.path.splitext(image_path)[0]
    out = [stem + caption_extension]
    match = _FACE_SUFFIX.match(stem)
    if match and match.group(1):
        out.append(match.group(1) + caption_extension)
    return out


def read_caption_file(image_path: str, caption_extension: str) -> tuple[Optional[str], Optional[str]]:
    """(caption, None), (None, None) when no caption file exists, or (None, problem)."""
    for path in caption_candidates(image_path, caption_extension):
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8-sig") as f:
                text = f.read().strip()
        except UnicodeDecodeError:
            return None, f"{path}: caption file is not UTF-8 text"
        except OSError as e:
            return None, f"{path}: cannot read caption file: {e.strerror or e}"
        if not text:
            return None, f"{path}: empty caption file (delete it to use the class tokens, or write a caption)"
        return "\n".join(line.strip() for line in text.splitlines() if line.strip()), None
    return None, None


def find_mask(image_path: str, mask_dir: str) -> Optional[str]:
    """The mask image in `mask_dir` with the same stem as `image_path` (any image extension)."""
    stem = os.path.splitext(os.path.basename(image_path))[0]
    for ext in IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS):
        candidate = os.path.join(mask_dir, stem + ext)
        if os.path.isfile(candidate):
            return candidate
    return None


def _attach_masks(sub: SubsetConfig, result: SubsetImages) -> None:
    """Pair each image with its conditioning_data_dir image: the mask (masked loss) or, for the control scripts
    (sub.conditioning_images), the conditioning image. A missing one is a problem naming the image."""
    mask_dir = sub.conditioning_data_dir
    if not mask_dir:
        return
    if not os.path.isdir(mask_dir):
        result.problems.append(f"{sub.where}.conditioning_data_dir: folder not found: {mask_dir}")
        return
    what = "conditioning image" if sub.conditioning_images else "mask image"
    for image in result.images:
        found = find_mask(image.path, mask_dir)
        if sub.conditioning_images:
            image.conditioning_path = found
        else:
            image.mask_path = found
        if found is None:
            result.problems.append(f"{image.path}: no {what} with the same name in {mask_dir}")


def discover_dreambooth(sub: SubsetConfig) -> SubsetImages:
    """Images of an image_dir subset with their caption files (or class tokens)."""
    result = SubsetImages()
    folder = sub.image_dir or ""
    if not os.path.isdir(folder):
        result.problems.append(f"{sub.where}: no images found in {folder}: the folder does not exist")
        return result
    paths = list_images(folder)
    result.skipped.update(broken_links(folder))
    if not paths:
        why = _no_images_reason(folder)
        if result.skipped:
            why = f"{len(result.skipped)} broken symbolic links (listed with the skipped images)"
        result.problems.append(f"{sub.where}: no images found in {folder}: {why}")
        return result
    for path in paths:
        caption, problem = read_caption_file(path, sub.caption_extension)
        if problem:
            result.problems.append(problem)
            continue
        if caption is None:
            result.missing_captions += 1
            caption = sub.class_tokens or ""
        result.images.append(DiscoveredImage(path, caption))
    _attach_masks(sub, result)
    return result


def _is_size(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))


def discover_finetune(sub: SubsetConfig) -> SubsetImages:
    """Images listed in a metadata file; caption = caption + ", " + tags (tags alone when no caption)."""
    result = SubsetImages()
    entries, result.problems = read_metadata_entries(sub.metadata_file or "")
    if sub.image_dir and not os.path.isdir(sub.image_dir):
        result.problems.append(f"{sub.where}.image_dir: folder not found: {sub.image_dir}")
        return result
    for key, entry in entries:
        path = resolve_image(key, sub.image_dir)
        if path is None:
            where = f" in {sub.image_dir}" if sub.image_dir else ""
            result.problems.append(f"{sub.metadata_file}: {key}: image not found{where}")
            continue
        caption, tags = entry.get("caption"), entry.get("tags")
        parts = [p.strip() for p in (caption, tags) if isinstance(p, str) and p.strip()]
        if not parts:
            result.problems.append(f"{sub.metadata_file}: {key}: no caption or tags")
            continue
        reso = entry.get("train_resolution")
        if reso is not None and not _is_size(reso):
            result.problems.append(f"{sub.metadata_file}: {key}: train_resolution: expected [width, height] "
                                   f"(two integers >= 1), got {json.dumps(reso)}")
            continue
        result.images.append(DiscoveredImage(path, ", ".join(parts),
                                             train_resolution=tuple(reso) if reso else None))
    if not result.images and not result.problems:
        result.problems.append(f"{sub.where}: no images found in {sub.metadata_file}: the metadata file lists no images")
    _attach_masks(sub, result)
    return result


def discover_subset(sub: SubsetConfig) -> SubsetImages:
    """Images, raw captions, masks and control images of one subset."""
    result = discover_finetune(sub) if sub.kind == "finetune" else discover_dreambooth(sub)
    attach_controls(sub, result)
    return result
