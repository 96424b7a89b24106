"""build_training_data: resolve config, discover, scan, split, balance reg images, bucket, and validate it all.

Every data problem is collected and reported together in one DataError (one
line each), so a user fixes the dataset once instead of restarting per error.
Image files that cannot be used (they do not decode, broken links, outside the
dataset's size limits) are skipped instead, all named in one warning, and kept
on the result as `skipped_images`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from typing import Optional, TypeVar, Union

from library.core.errors import ConfigError, DataError
from library.data.batching import Group, Placement, Sample, balance_reg_repeats
from library.data.buckets import (
    BucketManager,
    ImageTooSmallError,
    check_fixed_resolution,
    validate_bucket_settings,
)
from library.data.config import DatasetConfig, SubsetConfig, resolve_datasets
from library.data.discovery import DiscoveredImage, discover_subset
from library.data.hf_source import discover_dataset_subset
from library.data.image_scan import scan_image_sizes
from library.data.mask_sources import attach_masklabels, check_mask_sources
from library.data.options import DataOptions
from library.data.plan import DataFamilyInfo, DatasetPlan
from library.data.validation_split import split_for_validation

logger = logging.getLogger(__name__)
P = TypeVar("P", bound=DatasetPlan)

SIZE_CACHE_NAME = "image_size_cache.json"  # written in image_dir only when cache_info = true


def _check_bucket_settings(datasets: list[DatasetConfig], family: DataFamilyInfo, source: str) -> None:
    lines = []
    for ds in datasets:
        if not ds.enable_bucket:
            continue
        for reso in ds.resolutions:
            try:
                validate_bucket_settings(reso, ds.min_bucket_reso, ds.max_bucket_reso, ds.bucket_reso_steps,
                                         family.bucket_reso_multiple, f"{source}{ds.where}")
            except ConfigError as e:
                if str(e) not in lines:
                    lines.append(str(e))
    if lines:
        raise ConfigError("\n".join(lines))


def check_datasets(opts: DataOptions, family: DataFamilyInfo) -> None:
    """The dataset checks that read no image (--check_config): the dataset TOML resolved against the flags,
    and each dataset's bucket settings against its resolutions and the family's bucket multiple."""
    resolved = resolve_datasets(opts)
    _check_bucket_settings(resolved.datasets, family, f"{opts.dataset_config}: " if resolved.from_config_file else "")


def size_cache_path(sub: SubsetConfig) -> Optional[str]:
    """Where the image-size metadata cache of a subset lives.

    With `cache_info = true` it is `image_size_cache.json` in the image folder (as sd-scripts);
    otherwise a file per folder under the user cache directory, so that a second start of the
    same dataset is near-instant without writing into the dataset. LORA_TOOLKIT_CACHE_DIR moves it.
    """
    if not sub.image_dir:
        return None
    if sub.cache_info:
        return os.path.join(sub.image_dir, SIZE_CACHE_NAME)
    root = os.environ.get("LORA_TOOLKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lora-toolkit")
    key = hashlib.sha1(os.path.abspath(sub.image_dir).encode()).hexdigest()[:16]
    return os.path.join(root, "image_sizes", f"{key}.json")


def effective_min_side(ds: DatasetConfig) -> int:
    """min_image_side, but never more than the smallest side of the dataset's resolutions (0 = no limit)."""
    if not ds.min_image_side:
        return 0
    return min(ds.min_image_side, *(min(r) for r in ds.resolutions))


def size_problem(size: tuple[int, int], ds: DatasetConfig) -> Optional[str]:
    """Why an image of `size` (width, height) is skipped under the dataset's limits, or None."""
    w, h = size
    min_side = effective_min_side(ds)
    if min_side and min(w, h) < min_side:
        return (f"image is {w}x{h}, a side shorter than min_image_side {min_side} px (set min_image_side = 0 "
                "to train it anyway, as sd-scripts does)")
    ratio = max(w, h) / min(w, h)
    if ds.max_aspect_ratio and ratio > ds.max_aspect_ratio:
        return (f"image is {w}x{h}, aspect ratio {ratio:.3g}:1 beyond max_aspect_ratio {ds.max_aspect_ratio:g} "
                "(set max_aspect_ratio = 0 for no limit, as sd-scripts)")
    return None


def _scan_subset(sub: SubsetConfig, ds: DatasetConfig, images: list[DiscoveredImage], problems: list[str],
                 skipped: dict[str, str]) -> list[tuple[DiscoveredImage, tuple]]:
    """(image, size) of every image (and mask) that decodes and is within the dataset's size limits; the
    others go to `skipped` with the reason."""
    cache = size_cache_path(sub)
    paths = ([i.path for i in images] + [i.mask_path for i in images if i.mask_path]
             + [c for i in images for c in i.control_paths]
             + [i.conditioning_path for i in images if i.conditioning_path])
    scan = scan_image_sizes(paths, cache, progress=True)
    skipped.update(scan.problems)
    good = []
    for image in images:
        if image.path not in scan.sizes:
            continue
        if image.mask_path and image.mask_path not in scan.sizes:
            skipped[image.path] = f"its mask {image.mask_path} cannot be used ({scan.problems.get(image.mask_path)})"
            continue
        bad_control = next((c for c in image.control_paths if c not in scan.sizes), None)
        if bad_control:
            skipped[image.path] = f"its control image {bad_control} cannot be used ({scan.problems.get(bad_control)})"
            continue
        if image.conditioning_path:
            cond = image.conditioning_path
            if cond not in scan.sizes:
                skipped[image.path] = f"its conditioning image {cond} cannot be used ({scan.problems.get(cond)})"
                continue
            if ds.enable_bucket and scan.sizes[cond] != scan.sizes[image.path]:
                # sd-scripts asserts the same size with buckets (and resizes without: library/data/loading.py)
                (iw, ih), (cw, ch) = scan.sizes[image.path], scan.sizes[cond]
                problems.append(f"{cond}: conditioning image is {cw}x{ch} but its image {image.path} is {iw}x{ih}; "
                                "expected the same size (with enable_bucket)")
                continue
        why = size_problem(scan.sizes[image.path], ds)
        if why:
            skipped[image.path] = why
            continue
        good.append((image, scan.sizes[image.path]))
    if images and not good:
        problems.append(f"{sub.where}: no usable images in {sub.image_dir or sub.metadata_file or sub.dataset_name}: "
                        f"all {len(images)} images were skipped (listed in the warning above)")
    return good


def log_skipped(skipped: dict[str, str]) -> None:
    """One warning naming every image file left out, before anything is loaded or trained."""
    if skipped:
        logger.warning("%d image file(s) skipped, not trained:\n  %s", len(skipped),
                       "\n  ".join(f"{path}: {why}" for path, why in skipped.items()))


def _place(ds: DatasetConfig, reso: tuple[int, int], sub: SubsetConfig, size: tuple[int, int],
           manager: Optional[BucketManager], given: Optional[tuple[int, int]] = None) -> Union[Placement, str]:
    """Where an image goes at `reso`, or why it cannot be used. `given`: the bucket its fine-tune metadata
    entry names (train_resolution), used as it is once it passes the bucket rules."""
    value = f"train_resolution [{given[0]}, {given[1]}] in {sub.metadata_file}" if given else ""
    if given is not None and manager is None and tuple(given) != tuple(reso):
        return (f"{value}: expected the resolution {reso[0]}x{reso[1]} without enable_bucket "
                "(add --enable_bucket to use the file's buckets)")
    if given is not None and manager is not None:
        why = manager.given_bucket_problem(given, *size)
        if why:
            return f"{value}: {why}"
        bucket, resized, ar_error = manager.select_given(given, *size)
        manager.record_ar_error(ar_error)
        return Placement(bucket, resized)
    if manager is not None:
        try:
            bucket, resized, ar_error = manager.select_bucket(*size)
        except ImageTooSmallError as e:
            return str(e)
        manager.record_ar_error(ar_error)
        return Placement(bucket, resized)
    why = check_fixed_resolution(size, reso, sub.random_crop or bool(sub.face_crop_aug_range))
    return why if why else Placement(reso, size)


def _make_group(di: int, ds: DatasetConfig, ri: int, members: list[tuple[Sample, int]], subsets: list[SubsetConfig],
                validation: bool, problems: list[str]) -> Group:
    reso = ds.resolutions[ri]
    group = Group(dataset=di, resolution=reso, batch_size=ds.batch_sizes[ri], validation=validation)
    manager = None
    if ds.enable_bucket:
        manager = BucketManager(ds.bucket_no_upscale, reso, ds.min_bucket_reso, ds.max_bucket_reso, ds.bucket_reso_steps)
        if not ds.bucket_no_upscale:
            manager.make_buckets()
    # A metadata file's train_resolution is a bucket for one resolution: with several, buckets are computed.
    use_given = len(ds.resolutions) == 1
    for sample, repeats in members:
        placed = _place(ds, reso, subsets[sample.subset], sample.size, manager,
                        sample.train_resolution if use_given else None)
        if isinstance(placed, str):
            problems.append(f"{sample.path}: {placed}")
            continue
        group.placements[sample.id] = placed
        group.buckets.setdefault(placed.bucket, []).extend([sample.id] * repeats)
        if manager is not None:
            for _ in range(repeats):
                manager.add_image(placed.bucket, sample.id)
    if manager is not None:
        manager.sort()
        group.bucket_info = manager.bucket_info()
    else:
        group.bucket_info = {"buckets": {0: {"resolution": list(reso), "count": sum(map(len, group.buckets.values()))}},
                             "mean_img_ar_error": 0.0}
    return group


def _warn_missing_captions(sub: SubsetConfig, count: int) -> None:
    if not count:
        return
    if sub.kind == "datasets":
        logger.warning("%s: %d rows have no caption in column %r; using %s", sub.where, count, sub.caption_column,
                       repr(sub.class_tokens) if sub.class_tokens else "an empty caption")
        return
    if sub.class_tokens:
        logger.warning("%s: %d images have no %s caption file; using the class tokens %r",
                       sub.where, count, sub.caption_extension, sub.class_tokens)
    else:
        logger.warning("%s: %d images have no %s caption file and there are no class tokens; they train with an "
                       "empty caption", sub.where, count, sub.caption_extension)


def build(opts: DataOptions, family: DataFamilyInfo, make: type[P]) -> P:
    """See library.data.dataset.build_training_data; the result is a `make` (a DatasetPlan class)."""
    resolved = resolve_datasets(opts)
    source = f"{opts.dataset_config}: " if resolved.from_config_file else ""
    _check_bucket_settings(resolved.datasets, family, source)
    seed = opts.seed if opts.seed is not None else random.randint(0, 2**31 - 1)
    problems = list(resolved.problems)
    skipped: dict[str, str] = dict(resolved.skipped)
    subsets: list[SubsetConfig] = []
    samples: list[Sample] = []
    groups: list[Group] = []
    group_res: list[int] = []
    counts = {"train": 0, "reg": 0, "val": 0}

    def add_sample(img: DiscoveredImage, size, di, si, sub, repeats, is_val=False) -> Sample:
        s = Sample(id=len(samples), path=img.path, caption=img.caption, dataset=di, subset=si, size=size,
                   num_repeats=repeats, is_reg=sub.is_reg, is_validation=is_val,
                   loss_weight=opts.prior_loss_weight if sub.is_reg else 1.0, mask_path=img.mask_path,
                   conditioning_path=img.conditioning_path, train_resolution=img.train_resolution,
                   control_paths=img.control_paths)
        samples.append(s)
        return s

    for di, ds in enumerate(resolved.datasets):
        train: list[tuple[Sample, int]] = []
        val: list[tuple[Sample, int]] = []
        reg_found: list[tuple[DiscoveredImage, tuple, int, SubsetConfig]] = []
        for sub in ds.subsets:
            si = len(subsets)
            subsets.append(sub)
            if ds.enable_bucket and sub.face_crop_aug_range:
                logger.warning("%s: face_crop_aug_range only applies without enable_bucket; ignored", sub.where)
            found = discover_dataset_subset(sub) if sub.kind == "datasets" else discover_subset(sub)
            attach_masklabels(sub, found)
            mask_problem = check_mask_sources(sub, found)
            if mask_problem:
                found.problems.append(mask_problem)
            problems.extend(found.problems)
            skipped.update(found.skipped)
            _warn_missing_captions(sub, found.missing_captions)
            good = _scan_subset(sub, ds, found.images, problems, skipped)
            if sub.is_reg:
                reg_found.extend((img, size, si, sub) for img, size in good)
                continue
            seed_for_split = sub.validation_seed if sub.validation_seed is not None else seed
            train_part, val_part = split_for_validation(good, sub.validation_split, seed_for_split)
            train += [(add_sample(img, size, di, si, sub, sub.num_repeats), sub.num_repeats) for img, size in train_part]
            val += [(add_sample(img, size, di, si, sub, 1, is_val=True), 1) for img, size in val_part]
        # (an image of a control_directory subset without controls is a problem of its own, named above)
        control_counts = sorted({len(s.control_paths) for s, _ in train + val if s.control_paths or
                                 not subsets[s.subset].control_directory}
                                | {len(i.control_paths) for i, _, _, sub in reg_found if i.control_paths or
                                   not sub.control_directory})
        if control_counts and control_counts[-1] > family.max_control_images:
            takes = f"at most {family.max_control_images}" if family.max_control_images else "none"
            problems.append(f"{source}{ds.where}: {control_counts[-1]} control image(s) per image (control_directory), "
                            f"but this model takes {takes}" + (f"; {family.control_hint}" if family.control_hint else ""))
        if len(control_counts) > 1:  # a batch stacks its samples' controls (library/data/control_images.py)
            problems.append(f"{source}{ds.where}: every image of a dataset needs the same number of control images "
                            f"(control_directory); found {control_counts}")
        n_train = sum(r for _, r in train)
        reg_repeats = balance_reg_repeats(n_train, [sub.num_repeats for _, _, _, sub in reg_found])
        reg = [(add_sample(img, size, di, si, sub, r), r) for (img, size, si, sub), r in zip(reg_found, reg_repeats) if r > 0]
        if reg_found and not train:
            problems.append(f"{source}{ds.where}: has regularization images but no training images")
        counts["train"] += n_train
        counts["reg"] += len(reg)
        counts["val"] += len(val)
        val_resolutions = [len(ds.resolutions) - 1] if ds.resolution_schedule == "progressive" else range(len(ds.resolutions))
        for ri, reso in enumerate(ds.resolutions):
            group = _make_group(di, ds, ri, train + reg, subsets, False, problems)
            total = sum(map(len, group.buckets.values()))
            if train and total < group.batch_size:
                problems.append(f"{source}{ds.where}: {total} images (with repeats) at {reso[0]}x{reso[1]}, "
                                f"fewer than one batch (batch_size {group.batch_size})")
            groups.append(group)
            group_res.append(ri)
            if val and ri in val_resolutions:
                groups.append(_make_group(di, ds, ri, val, subsets, True, problems))
                group_res.append(ri)
    log_skipped(skipped)
    if problems:
        unique = list(dict.fromkeys(problems))
        if len(unique) == 1:
            raise DataError(unique[0])
        raise DataError(f"{len(unique)} problems in the training data; fix them and start again:\n  "
                        + "\n  ".join(unique))
    return make(opts=opts, family=family, seed=seed, datasets=resolved.datasets, subsets=subsets,
                samples=samples, groups=groups, group_resolution_index=group_res,
                from_config_file=resolved.from_config_file, num_train_images=counts["train"],
                num_reg_images=counts["reg"], num_validation_images=counts["val"], skipped_images=skipped)
