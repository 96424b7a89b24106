"""Control (reference) images of edit training: the subset key `control_directory` (musubi-tuner's name).

Each training image `<stem>.<ext>` has its control image(s) in `control_directory` under the same stem:
`<stem>.<ext>` for one, or `<stem>_0.<ext>`, `<stem>_1.<ext>`, ... (consecutive from 0) for several. A missing
control image is a data problem (named before anything is loaded); one that does not decode skips its target image
with the reason, as a training image that does not decode is skipped. At load time each control is resized to cover
the target's bucket and centre-cropped to it (FluxKontextPipeline gives the reference image the output's size), and
flipped with the target.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from library.data.images import IMAGE_EXTENSIONS, load_image, resize_and_crop_with_mask

MAX_CONTROLS = 3  # Qwen-Image-Edit-2509/2511 take up to 3 reference images


def _find(folder: str, stem: str) -> Optional[str]:
    for ext in IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS):
        candidate = os.path.join(folder, stem + ext)
        if os.path.isfile(candidate):
            return candidate
    return None


def find_controls(image_path: str, control_dir: str) -> tuple[str, ...]:
    """The control images of `image_path` in `control_dir`: `<stem>.*`, else `<stem>_0.*`, `<stem>_1.*`, ..."""
    stem = os.path.splitext(os.path.basename(image_path))[0]
    single = _find(control_dir, stem)
    if single:
        return (single,)
    found = []
    while len(found) <= MAX_CONTROLS:  # one past the most any model takes, so that a 4th is named, not dropped
        path = _find(control_dir, f"{stem}_{len(found)}")
        if path is None:
            break
        found.append(path)
    return tuple(found)


def attach_controls(sub, result) -> None:
    """Set `control_paths` on each discovered image of a subset with `control_directory`; problems go to
    `result.problems` (the folder missing, an image without a control, subsets mixing control counts)."""
    folder = sub.control_directory
    if not folder:
        return
    if not os.path.isdir(folder):
        result.problems.append(f"{sub.where}.control_directory: folder not found: {folder}")
        return
    counts = set()
    for image in result.images:
        image.control_paths = find_controls(image.path, folder)
        if not image.control_paths:
            stem = os.path.splitext(os.path.basename(image.path))[0]
            result.problems.append(f"{image.path}: no control image {stem}.png (or {stem}_0.png, {stem}_1.png, ...) "
                                   f"in {folder}")
        else:
            counts.add(len(image.control_paths))
    if len(counts) > 1:
        result.problems.append(f"{sub.where}.control_directory: every image needs the same number of control images; "
                               f"found {sorted(counts)} in {folder}")


def cover_size(size: tuple[int, int], bucket: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of an image of `size` scaled to cover `bucket` (the smallest scale that does)."""
    w, h = size
    scale = max(bucket[0] / w, bucket[1] / h)
    return max(bucket[0], round(w * scale)), max(bucket[1], round(h * scale))


def load_control(path: str, bucket: tuple[int, int], flip: bool, interpolation: Optional[str] = None) -> np.ndarray:
    """One control image as (H, W, 3) uint8 at the target's bucket: resized to cover it, centre-cropped, flipped
    with the target. Raises ImageDecodeError when it cannot be decoded."""
    image, _ = load_image(path)
    size = (image.shape[1], image.shape[0])
    out, _, _ = resize_and_crop_with_mask(image, None, bucket, cover_size(size, bucket), False, None, interpolation)
    return np.ascontiguousarray(out[:, ::-1]) if flip else out


def control_signature(paths: tuple[str, ...]) -> str:
    """What cached control latents were made from (part of the latent cache settings): each control file's name,
    size and mtime, so a changed control image rebuilds the entry; "" without controls."""
    parts = []
    for path in paths:
        try:
            st = os.stat(path)
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            stamp = "missing"
        parts.append(f"{os.path.basename(path)}:{stamp}")
    return "|".join(parts)
