"""Turn a planned batch into tensors: decode, crop, augment, caption pipeline (or cached latents)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from library.data.batching import BatchRef, Placement, Sample, sample_noise_seed, sample_rng
from library.data.captions import process_caption
from library.data.config import SubsetConfig
from library.data.control_images import load_control
from library.data.images import (
    ImageDecodeError,
    color_augment,
    face_crop,
    flip_crop_ltrb,
    flip_horizontal,
    load_image,
    parse_face_box,
    resize_and_crop,
    resize_and_crop_all,
    resize_image,
    resize_mask,
    to_tensor,
    to_unit_tensor,
)
from library.data.mask_sources import draw_unmasked, mask_channel
from library.data.plan import DatasetPlan

logger = logging.getLogger(__name__)
_warned: set[str] = set()


@dataclass
class LoadedImage:
    image: np.ndarray  # (H, W, 3) uint8 at the bucket size
    mask: Optional[np.ndarray]  # (H, W) float 0..1 or None
    crop_ltrb: tuple[int, int, int, int]
    conditioning: Optional[np.ndarray] = None  # (H, W, 3) uint8 at the bucket size, cropped as `image`


def warn_once(path: str, message: str) -> None:
    """Log a skipped image once per process (workers each log their own first time)."""
    if path not in _warned:
        _warned.add(path)
        logger.warning("skipping %s", message)


def _load_mask(sample: Sample, size: tuple[int, int]) -> np.ndarray:
    rgb, _ = load_image(sample.mask_path)
    mask = mask_channel(rgb, sample.mask_path)  # R channel (conditioning_data_dir, as sd-scripts) or grey (-masklabel.png)
    return resize_mask(mask, size) if (mask.shape[1], mask.shape[0]) != size else mask


def load_conditioning(sample: Sample, sub: SubsetConfig) -> np.ndarray:
    """The conditioning image at its image's original size: decoded (alpha dropped, as sd-scripts' convert("RGB")),
    and resized to the image's size when it differs (only without buckets; with buckets the scan refused it)."""
    cond, _ = load_image(sample.conditioning_path, background=None)
    if (cond.shape[1], cond.shape[0]) != sample.size:
        cond = resize_image(cond, sample.size, sub.resize_interpolation)
    return cond


def crop_conditioning(sample: Sample, sub: SubsetConfig, place: Placement) -> np.ndarray:
    """The conditioning image of a sample whose latents are cached: resized and centre-cropped to its bucket, as
    the cached image was (random crop cannot be cached)."""
    cond, _ = resize_and_crop(load_conditioning(sample, sub), place.bucket, place.resized, False, random.Random(0),
                              sub.resize_interpolation)
    return cond


def load_and_crop(sample: Sample, sub: SubsetConfig, place: Placement, bucketing: bool, rng: random.Random,
                  augment: bool, with_conditioning: bool = True) -> LoadedImage:
    """Decode one image (+ mask, + conditioning image unless not `with_conditioning`: latent caching), resize and
    crop it to its bucket; random crop / face crop / color aug when `augment`.

    Raises ImageDecodeError when the image (or its mask) cannot be decoded or changed size since scanning.
    """
    image, alpha = load_image(sample.path, with_alpha=sub.alpha_mask)
    size = (image.shape[1], image.shape[0])
    if size != sample.size:
        raise ImageDecodeError(f"{sample.path}: image is {size[0]}x{size[1]} now but was {sample.size[0]}x{sample.size[1]} "
                               "when the dataset was scanned")
    mask = _load_mask(sample, size) if sample.mask_path else alpha
    resized = place.resized
    if augment and not bucketing and sub.face_crop_aug_range:
        image = face_crop(image, sub.face_crop_aug_range, rng, parse_face_box(sample.path), place.bucket, sub.random_crop)
        resized = (image.shape[1], image.shape[0])
        mask = resize_mask(mask, resized) if mask is not None else None
    cond = load_conditioning(sample, sub) if sample.conditioning_path and with_conditioning else None
    image, mask, cond, crop_ltrb = resize_and_crop_all(image, mask, cond, place.bucket, resized,
                                                       augment and sub.random_crop, rng, sub.resize_interpolation)
    if augment and sub.color_aug:  # the image only: the conditioning image stays as drawn (sd-scripts)
        image = color_augment(image, rng)
    return LoadedImage(image, mask, crop_ltrb, cond)


def load_batch(data: DatasetPlan, ref: BatchRef) -> dict:
    """The batch dict of `ref` (see DatasetPlan.load_batch); `image_paths` is empty when no image could be loaded."""
    group = data.groups[ref.group]
    augment = not ref.validation
    images, latents, masks, captions, weights, paths = [], [], [], [], [], []
    unmasked_weights, normalize, preserve = [], [], []
    orig_hw, crop_tl, skipped, noise_seeds, controls, conds, control_paths = [], [], [], [], [], [], []
    use_latents = all((sid, ref.group) in data.latents for sid in ref.samples)
    for pos, sid in enumerate(ref.samples):
        sample = data.samples[sid]
        if sample.path in data.bad_paths:
            skipped.append(sample.path)
            continue
        sub = data.subsets[sample.subset]
        rng = sample_rng(data.seed, ref.epoch, ref.index, ref.offset + pos, ref.validation)
        settings = sub.captions if augment else sub.captions.without_randomness()
        # The caption and the flip decision are drawn first, so they are the same with or without cached latents.
        caption = process_caption(sample.caption, settings, rng, ref.epoch, ref.step, data.max_train_steps,
                                  data.caption_replacements)
        if data.caption_templates:  # textual inversion's --use_object_template / --use_style_template
            caption = rng.choice(data.caption_templates)
        flip = augment and sub.flip_aug and rng.random() < 0.5
        bw = group.placements[sid].bucket[0]
        try:
            if use_latents:
                entry = data.latents[(sid, ref.group)]
                cond = crop_conditioning(sample, sub, group.placements[sid]) if sample.conditioning_path else None
                latents.append(entry.latents_flipped if flip else entry.latents)
                crop = flip_crop_ltrb(entry.crop_ltrb, bw) if flip else entry.crop_ltrb
                mask = entry.alpha_mask
                if sample.mask_path and mask is None:  # a cache file written without the mask (another tool)
                    mask = load_and_crop(sample, sub, group.placements[sid], data.bucketing(group), rng, False).mask
                if mask is not None and flip:
                    mask = np.ascontiguousarray(mask[:, ::-1])
                control = list(entry.control_latents_flipped if flip else entry.control_latents)
            else:
                loaded = load_and_crop(sample, sub, group.placements[sid], data.bucketing(group), rng, augment)
                image, mask, crop, cond = loaded.image, loaded.mask, loaded.crop_ltrb, loaded.conditioning
                if flip:
                    image = flip_horizontal(image)
                    mask = np.ascontiguousarray(mask[:, ::-1]) if mask is not None else None
                    crop = flip_crop_ltrb(crop, bw)
                control = [to_tensor(load_control(c, group.placements[sid].bucket, flip, sub.resize_interpolation))
                           for c in sample.control_paths]
                images.append(to_tensor(image))
            if cond is not None:
                conds.append(to_unit_tensor(flip_horizontal(cond) if flip else cond))
        except ImageDecodeError as e:
            warn_once(sample.path, str(e))
            skipped.append(sample.path)
            continue
        if mask is not None and augment and draw_unmasked(sub, rng):
            mask = np.ones_like(mask)  # this step trains the whole image (unmasked_probability)
        masks.append(mask)
        controls.append(control)
        unmasked_weights.append(sub.unmasked_weight)
        normalize.append(sub.normalize_masked_area_loss)
        preserve.append(bool(sub.custom_attributes.get("diff_output_preservation")))
        captions.append(caption)
        weights.append(sample.loss_weight)
        paths.append(sample.path)
        control_paths.append(sample.control_paths)
        noise_seeds.append(sample_noise_seed(data.seed, ref.epoch, ref.index, ref.offset + pos))
        orig_hw.append((sample.size[1], sample.size[0]))
        crop_tl.append((crop[1], crop[0]))
    if not paths:  # no image of the batch could be loaded: no step is taken, the names are reported
        return {"image_paths": [], "skipped_images": skipped}
    bucket = group.placements[ref.samples[0]].bucket
    has_masks = any(m is not None for m in masks)
    return {
        "images": torch.stack(images) if images else None,
        # The control scripts: each image's conditioning image, cropped and flipped with it, (B, 3, H, W) in 0..1.
        "conditioning_images": torch.stack(conds) if conds else None,
        "latents": torch.stack([torch.as_tensor(x) for x in latents]).float() if latents else None,
        "captions": captions,
        "loss_weights": torch.tensor(weights, dtype=torch.float32),
        "masks": torch.stack([torch.from_numpy(np.asarray(m if m is not None else np.ones((bucket[1], bucket[0]), np.float32)))
                              for m in masks]).unsqueeze(1).float() if has_masks else None,
        # Per sample: the loss weight outside the mask, and whether the loss is divided by the mask weights' mean.
        "mask_unmasked_weights": torch.tensor(unmasked_weights, dtype=torch.float32) if has_masks else None,
        "mask_normalize": torch.tensor(normalize, dtype=torch.bool) if has_masks else None,
        # Per sample: its subset's custom_attributes.diff_output_preservation (library/train/step.py preserved_target)
        "diff_output_preservation": torch.tensor(preserve, dtype=torch.bool) if any(preserve) else None,
        "original_sizes_hw": torch.tensor(orig_hw, dtype=torch.long),
        "crop_top_lefts": torch.tensor(crop_tl, dtype=torch.long),
        "target_sizes_hw": torch.tensor([(bucket[1], bucket[0])] * len(paths), dtype=torch.long),
        "image_paths": paths,
        # Edit training: each sample's control image files (family.text_key: Qwen-Image-Edit's text reads them)
        "control_paths": control_paths,
        # Training batches: each sample's noise and timestep seed (library/train/step.py); validation draws its own.
        "noise_seeds": None if ref.validation else noise_seeds,
        "skipped_images": skipped,
        # Edit training (control_directory): one (B, 3, H, W) pixel batch per control index, or with cached latents
        # one (B, C, h, w) latent batch each (`control_latents`); the step encodes pixels (library/train/step.py).
        **_control_batch(controls, use_latents),
    }


def _control_batch(controls: list[list], use_latents: bool) -> dict:
    if not controls or not controls[0]:
        return {}
    stacked = [torch.stack([torch.as_tensor(c[i]) for c in controls]).float() for i in range(len(controls[0]))]
    return {"control_latents": stacked} if use_latents else {"control_images": stacked}
