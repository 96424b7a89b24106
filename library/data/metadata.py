"""The dataset part of the ss_* metadata written into LoRA files (sd-scripts key names and value forms)."""

from __future__ import annotations

import json
import os

from library.data.captions import tag_frequency
from library.data.plan import DatasetPlan


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _dir_name(sub) -> str:
    return os.path.basename(os.path.normpath(sub.image_dir or sub.metadata_file or sub.dataset_name or ""))


def _subset_counts(data: DatasetPlan) -> list[int]:
    counts = [0] * len(data.subsets)
    for s in data.samples:
        if not s.is_validation:
            counts[s.subset] += 1
    return counts


def _tag_frequency(data: DatasetPlan, dataset: int) -> dict[str, dict[str, int]]:
    """{dir name: {tag: count}} over the raw captions of the dataset's training images."""
    out: dict[str, dict[str, int]] = {}
    for i, sub in enumerate(data.subsets):
        captions = [s.caption for s in data.samples
                    if s.subset == i and s.dataset == dataset and not s.is_validation]
        if not captions:
            continue
        freq = out.setdefault(_dir_name(sub), {})
        for tag, n in tag_frequency(captions, sub.captions.caption_separator).items():
            freq[tag] = freq.get(tag, 0) + n
    return out


def _dataset_dirs(data: DatasetPlan, reg: bool) -> dict[str, dict[str, int]]:
    counts = _subset_counts(data)
    return {_dir_name(sub): {"n_repeats": sub.num_repeats, "img_count": counts[i]}
            for i, sub in enumerate(data.subsets) if sub.is_reg == reg}


def _first_train_group(data: DatasetPlan, dataset: int):
    return next(g for g in data.groups if g.dataset == dataset and not g.validation)


def _subset_entry(sub, count: int) -> dict:
    c = sub.captions
    entry = {
        "img_count": count, "num_repeats": sub.num_repeats, "color_aug": sub.color_aug, "flip_aug": sub.flip_aug,
        "random_crop": sub.random_crop, "shuffle_caption": c.shuffle_caption, "keep_tokens": c.keep_tokens,
        "keep_tokens_separator": c.keep_tokens_separator, "secondary_separator": c.secondary_separator,
        "enable_wildcard": c.enable_wildcard, "caption_prefix": c.caption_prefix, "caption_suffix": c.caption_suffix,
        "alpha_mask": sub.alpha_mask,
    }
    if sub.masked_loss:  # our extension (OneTrainer-style masked training)
        entry.update(masked_loss=True, unmasked_probability=sub.unmasked_probability,
                     unmasked_weight=sub.unmasked_weight, normalize_masked_area_loss=sub.normalize_masked_area_loss)
    if sub.kind == "datasets":  # our extension: a Hugging Face datasets source
        entry.update(dataset_name=_dir_name(sub), dataset_split=sub.dataset_split, is_reg=sub.is_reg)
    elif sub.kind == "dreambooth":
        entry.update(image_dir=_dir_name(sub), class_tokens=sub.class_tokens, is_reg=sub.is_reg)
    else:
        entry.update(image_dir=os.path.basename(sub.image_dir) if sub.image_dir else None,
                     metadata_file=os.path.basename(sub.metadata_file or ""))
    return entry


def _datasets_json(data: DatasetPlan) -> list[dict]:
    counts = _subset_counts(data)
    out = []
    first = 0  # subsets are flattened dataset by dataset
    for di, ds in enumerate(data.datasets):
        samples = [s for s in data.samples if s.dataset == di and not s.is_validation]
        entry = {
            "is_dreambooth": ds.is_dreambooth,
            "batch_size_per_device": ds.batch_sizes[0],
            "num_train_images": sum(s.num_repeats for s in samples if not s.is_reg),
            "num_reg_images": sum(1 for s in samples if s.is_reg),
            "resolution": list(ds.resolutions[0]),
            "enable_bucket": ds.enable_bucket,
            # sd-scripts: None (null) without bucketing
            "min_bucket_reso": ds.min_bucket_reso if ds.enable_bucket else None,
            "max_bucket_reso": ds.max_bucket_reso if ds.enable_bucket else None,
            "tag_frequency": _tag_frequency(data, di),
            "bucket_info": _first_train_group(data, di).bucket_info if ds.enable_bucket else None,
            "subsets": [_subset_entry(sub, counts[first + j]) for j, sub in enumerate(ds.subsets)],
        }
        if len(ds.resolutions) > 1:  # our extension: every resolution and its batch size
            entry["resolutions"] = [list(r) for r in ds.resolutions]
            entry["batch_sizes"] = list(ds.batch_sizes)
            entry["resolution_schedule"] = ds.resolution_schedule
        out.append(entry)
        first += len(ds.subsets)
    return out


def dataset_metadata(data: DatasetPlan) -> dict[str, str]:
    """ss_datasets (with a dataset config) or the flat keys (folder mode), plus counts; every value a string."""
    meta: dict[str, str] = {
        "ss_num_train_images": str(data.num_train_images),
        "ss_num_reg_images": str(data.num_reg_images),
        "ss_num_validation_images": str(data.num_validation_images),
        "ss_num_batches_per_epoch": str(data.batches_per_epoch()),
        "ss_dataset_dirs": _dumps(_dataset_dirs(data, reg=False)),
        "ss_tag_frequency": _dumps({k: v for di in range(len(data.datasets)) for k, v in _tag_frequency(data, di).items()}),
    }
    if data.from_config_file:  # bucket settings and bucket_info are per dataset, inside ss_datasets
        meta["ss_datasets"] = _dumps(_datasets_json(data))
        return meta
    ds = data.datasets[0]
    sub = data.subsets[0] if data.subsets else None
    c = sub.captions if sub else None
    meta.update({
        "ss_batch_size_per_device": str(ds.batch_sizes[0]),
        "ss_resolution": str(tuple(ds.resolutions[0])),
        "ss_enable_bucket": str(ds.enable_bucket),
        "ss_bucket_no_upscale": str(bool(ds.enable_bucket and ds.bucket_no_upscale)),
        "ss_reg_dataset_dirs": _dumps(_dataset_dirs(data, reg=True)),
        "ss_prior_loss_weight": str(data.opts.prior_loss_weight),
    })
    if ds.enable_bucket:  # without bucketing these say nothing (sd-scripts writes "None" / "null")
        meta.update({
            "ss_min_bucket_reso": str(ds.min_bucket_reso),
            "ss_max_bucket_reso": str(ds.max_bucket_reso),
            "ss_bucket_info": _dumps(_first_train_group(data, 0).bucket_info),
        })
    if sub is not None:
        meta.update({
            "ss_keep_tokens": str(c.keep_tokens),
            "ss_shuffle_caption": str(c.shuffle_caption),
            "ss_caption_dropout_rate": str(c.caption_dropout_rate),
            "ss_caption_dropout_every_n_epochs": str(c.caption_dropout_every_n_epochs),
            "ss_caption_tag_dropout_rate": str(c.caption_tag_dropout_rate),
            "ss_color_aug": str(sub.color_aug),
            "ss_flip_aug": str(sub.flip_aug),
            "ss_random_crop": str(sub.random_crop),
            "ss_face_crop_aug_range": str(sub.face_crop_aug_range),
        })
    return meta
