"""Where a sample's loss mask comes from, and the per-sample mask weights of masked training.

Three sources, first match wins for each image (docs/dataset_config.md "Masks"):

1. `conditioning_data_dir`: a mask image with the same stem in that folder (sd-scripts; the red channel);
2. `<image stem>-masklabel.png` beside the image (OneTrainer; grayscale, white = train), with `masked_loss`;
3. the image's alpha channel, with `alpha_mask = true` (sd-scripts).

A `-masklabel.png` file whose image is in the same folder is a mask, never a training image.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Optional

import numpy as np

from library.data.config import SubsetConfig
from library.data.discovery import SubsetImages, read_caption_file

logger = logging.getLogger(__name__)

MASKLABEL_SUFFIX = "-masklabel.png"


def masklabel_path(image_path: str) -> str:
    """`<dir>/<stem>-masklabel.png` for an image path."""
    return os.path.splitext(image_path)[0] + MASKLABEL_SUFFIX


def is_masklabel(path: str) -> bool:
    return os.path.basename(path).lower().endswith(MASKLABEL_SUFFIX)


def mask_kind(mask_path: str) -> str:
    """"luminance" for a -masklabel.png (grayscale), "red" for a conditioning_data_dir mask (sd-scripts' R channel)."""
    return "luminance" if is_masklabel(mask_path) else "red"


def mask_channel(rgb: np.ndarray, mask_path: str) -> np.ndarray:
    """(H, W) float32 0..1 from a decoded (H, W, 3) uint8 mask image, by the rule of its source."""
    if mask_kind(mask_path) == "luminance":
        # ITU-R 601-2 luma, as PIL's convert("L"); a grayscale file gives its grey values exactly.
        r, g, b = (rgb[:, :, i].astype(np.int32) for i in range(3))
        grey = (r * 299 + g * 587 + b * 114 + 500) // 1000
        return grey.astype(np.float32) / 255.0
    return rgb[:, :, 0].astype(np.float32) / 255.0


def mask_signature(mask_path: Optional[str], alpha_mask: bool) -> str:
    """What the cached mask was made from (part of the latent cache settings): a mask file's kind, name,
    size and mtime; "" for the alpha channel (CacheSettings.alpha_mask covers it) or no mask."""
    if mask_path is None:
        return ""
    try:
        st = os.stat(mask_path)
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        stamp = "missing"
    return f"{mask_kind(mask_path)}:{os.path.basename(mask_path)}:{stamp}"


def attach_masklabels(sub: SubsetConfig, found: SubsetImages) -> None:
    """Drop `-masklabel.png` files that belong to an image from the image list; with masked_loss, attach
    them as the mask of images that have no conditioning_data_dir mask."""
    by_stem = {os.path.splitext(i.path)[0]: i for i in found.images if not is_masklabel(i.path)}
    kept, dropped = [], []
    for image in found.images:
        owner = image.path[: -len(MASKLABEL_SUFFIX)] if is_masklabel(image.path) else None
        if owner is not None and owner in by_stem:
            dropped.append(image.path + ":")
            if read_caption_file(image.path, sub.caption_extension)[0] is None and found.missing_captions:
                found.missing_captions -= 1  # it was counted as an image without a caption file
            continue
        kept.append(image)
    found.images = kept
    if dropped:  # e.g. "no mask image with the same name" for the mask file itself
        found.problems = [p for p in found.problems if not p.startswith(tuple(dropped))]
    if not sub.masked_loss:
        return
    for image in found.images:
        if image.mask_path is None:
            candidate = masklabel_path(image.path)
            if os.path.isfile(candidate):
                image.mask_path = candidate


def check_mask_sources(sub: SubsetConfig, found: SubsetImages) -> Optional[str]:
    """A problem line when a masked_loss subset has no mask at all; a warning when only some images have one."""
    if not sub.masked_loss or sub.alpha_mask or sub.is_reg or not found.images:
        return None
    with_mask = sum(1 for i in found.images if i.mask_path)
    if with_mask == 0:
        return (f"{sub.where}: masked_loss needs masks: alpha_mask = true, conditioning_data_dir, or "
                f"<image stem>{MASKLABEL_SUFFIX} files beside the images")
    if with_mask < len(found.images):
        logger.warning("%s: %d of %d images have no %s file; they train without a mask",
                       sub.where, len(found.images) - with_mask, len(found.images), MASKLABEL_SUFFIX)
    return None


def draw_unmasked(sub: SubsetConfig, rng: random.Random) -> bool:
    """Whether this sample trains without its mask this step (probability unmasked_probability).

    Drawn from the sample's own generator of the step (seed, epoch, batch, position), after every other
    draw of the sample, so a resumed run draws the same and runs with probability 0 draw nothing.
    """
    p = sub.unmasked_probability
    if p <= 0.0:
        return False
    return p >= 1.0 or rng.random() < p
