"""Dataset flags: the sd-scripts names and defaults, translated into DataOptions in one place."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

from library.cli.options import RATE, Range, SEED, add_flags, at_least, flag, flag_specs, settings_from
from library.data.options import RESIZE_INTERPOLATIONS, DataOptions

logger = logging.getLogger(__name__)


@dataclass
class DatasetFlags:
    """The sd-scripts dataset flags (same names and defaults); DataOptions takes each as it is."""
    flag_group: ClassVar[str] = "dataset"
    train_data_dir: Optional[str] = flag(None, "folder of N_name subfolders (N = repeats) or images for --in_json")
    reg_data_dir: Optional[str] = flag(None, "folder of N_name subfolders of regularization images")
    in_json: Optional[str] = flag(None, "fine-tune metadata file (.json or .jsonl)")
    dataset_config: Optional[str] = flag(None, "dataset TOML; overrides --train_data_dir/--reg_data_dir/--in_json")
    dataset_repeats: int = flag(1, "repeats of the --in_json dataset", range=at_least(1))
    resolution: Optional[str] = flag(None, "'size' or 'width,height'; several resolutions separated by ';' (e.g. "
                                           "'512;768')")
    train_batch_size: int = flag(1, "images per batch (per device)", range=at_least(1))
    enable_bucket: bool = flag(False, "aspect-ratio buckets")
    min_bucket_reso: int = flag(256, "smallest bucket side (with --enable_bucket)", range=at_least(1))
    max_bucket_reso: int = flag(1024, "largest bucket side (with --enable_bucket)", range=at_least(1))
    bucket_reso_steps: int = flag(64, "bucket side step; a multiple of 64 for SD 1.x/2.x", range=at_least(1))
    bucket_no_upscale: bool = flag(False, "never enlarge an image to fill a bucket")
    keep_bucket_order: bool = flag(False, "keep each bucket's images in dataset order (file names sorted) instead of "
                                          "shuffling them every epoch; the order of the batches is still shuffled")
    caption_extension: str = flag(".caption", "caption file extension (default .caption; most datasets use .txt)",
                                              aliases=("caption_extention",))
    shuffle_caption: bool = flag(False, "shuffle the caption's tags (after the kept ones) every time")
    caption_separator: str = flag(",", "tag separator of captions")
    keep_tokens: int = flag(0, "keep the first N tags in place when shuffling", range=at_least(0))
    keep_tokens_separator: str = flag("", "tags before (and after a second) separator stay in place")
    secondary_separator: Optional[str] = flag(None, "joins tags that are shuffled as one; replaced by "
                                                    "caption_separator")
    enable_wildcard: bool = flag(False, "{a|b} choices and one random line of multi-line captions")
    caption_prefix: Optional[str] = flag(None, "text added before every caption")
    caption_suffix: Optional[str] = flag(None, "text added after every caption")
    color_aug: bool = flag(False, "random hue/saturation/value changes (not with --cache_latents)")
    flip_aug: bool = flag(False, "random horizontal flips (flipped latents are cached too)")
    face_crop_aug_range: Optional[str] = flag(None, "e.g. '2.0,4.0'")
    random_crop: bool = flag(False, "random instead of centre crop (not with --cache_latents)")
    token_warmup_min: int = flag(1, "tags used at the start of token warmup", range=at_least(0))
    token_warmup_step: float = flag(0, "steps (or a fraction < 1 of max_train_steps)", range=Range(lo=0))
    caption_dropout_rate: float = flag(0.0, "probability of training a sample with an empty caption", range=RATE)
    caption_dropout_every_n_epochs: int = flag(0, "use empty captions every N-th epoch", range=at_least(0))
    caption_tag_dropout_rate: float = flag(0.0, "probability of dropping each (non-kept) tag", range=RATE)
    prior_loss_weight: float = flag(1.0, "loss weight of regularization images", range=Range(lo=0))
    cache_latents: bool = flag(False, "encode every image once before training and keep the latents in memory")
    cache_latents_to_disk: bool = flag(False, "also keep them in <image>_<W>x<H>_<arch>.npz files, checked on reuse "
                                              "(implies --cache_latents)")
    vae_batch_size: int = flag(1, "images per VAE batch while caching", range=at_least(1))
    skip_cache_check: bool = flag(False, "accept sd-scripts cache files (no settings signature) whose shapes match",
                                  aliases=("skip_latents_validity_check",))
    max_data_loader_n_workers: int = flag(8, "capped at the CPU count", range=at_least(0))
    cache_info: bool = flag(False, "accepted for sd-scripts compatibility: image sizes are read from file headers "
                                   "here, there is no meta-information cache to write")
    persistent_data_loader_workers: bool = flag(False, "keep data-loader workers alive between epochs")
    validation_split: float = flag(0.0, "fraction of the images held out for validation loss",
                                        range=Range(0, 1, hi_open=True))
    validation_seed: Optional[int] = flag(None, "seed of the validation split (default: --seed)",
                                                range=SEED)
    alpha_mask: bool = flag(False, "use the image alpha channel as the loss mask")
    masked_loss: bool = flag(False, "weight the loss by the mask: conditioning_data_dir image, else "
                                    "<stem>-masklabel.png, else alpha")
    unmasked_probability: float = flag(0.0, "share of samples trained without their mask (drawn per sample, per step;"
                                            " OneTrainer uses 0.1)", range=RATE)
    unmasked_weight: float = flag(0.0, "loss weight outside the mask (0 = sd-scripts' masked loss; OneTrainer uses "
                                       "0.1)", range=RATE)
    normalize_masked_area_loss: bool = flag(False, "divide each sample's loss by the mean of its mask weights, so "
                                                   "small masks are not down-weighted")
    conditioning_data_dir: Optional[str] = flag(None, "mask images (R channel) with the same stems; in the ControlNet "
                                                      "scripts the conditioning images")
    resize_interpolation: Optional[str] = flag(None, "resampling filter (default: area to shrink, lanczos to enlarge)",
                                                     choices=RESIZE_INTERPOLATIONS)
    resolution_schedule: str = flag("all", "'progressive': train several resolutions in order, low to high",
                                           choices=("all", "progressive"))
    resolution_step_fractions: Optional[str] = flag(None, "progressive schedule, e.g. '0.3,0.7'")
    min_image_side: Optional[int] = flag(None, "skip (and name) images with a side shorter than this, in pixels "
                                               "(default 64, or the smallest resolution side if smaller; 0 = no "
                                               "limit, as sd-scripts)", range=at_least(0))
    max_aspect_ratio: Optional[float] = flag(None, "skip (and name) images whose longer side is more than this many "
                                                   "times the shorter (default 8; 0 = no limit, as sd-scripts)",
                                                   range=Range(lo=0, note="0 = no limit"))


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sd-scripts dataset flags (same names and defaults) to `parser`."""
    add_flags(parser, flag_specs(DatasetFlags))


def data_options_from_args(ns: argparse.Namespace, seed: Optional[int] = None) -> DataOptions:
    """The one place the argparse namespace becomes DataOptions (missing attributes keep their defaults).
    `seed`: the run's seed (drawn when --seed is not given), else the flag."""
    if ns.cache_latents_to_disk and not ns.cache_latents:
        logger.info("--cache_latents_to_disk implies --cache_latents")
    return settings_from(DataOptions, ns, **({} if seed is None else {"seed": seed}))
