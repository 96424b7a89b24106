"""Dataset flags: the sd-scripts names and defaults, translated into DataOptions in one place."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import Optional

from library.data.options import RESIZE_INTERPOLATIONS, DataOptions

logger = logging.getLogger(__name__)


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sd-scripts dataset flags (same names and defaults) to `parser`."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--train_data_dir", type=str, default=None, help="folder of N_name subfolders (N = repeats) or images for --in_json")
    g.add_argument("--reg_data_dir", type=str, default=None, help="folder of N_name subfolders of regularization images")
    g.add_argument("--in_json", type=str, default=None, help="fine-tune metadata file (.json or .jsonl)")
    g.add_argument("--dataset_config", type=str, default=None, help="dataset TOML; overrides --train_data_dir/--reg_data_dir/--in_json")
    g.add_argument("--dataset_repeats", type=int, default=1, help="repeats of the --in_json dataset")
    g.add_argument("--resolution", type=str, default=None,
                   help="'size' or 'width,height'; several resolutions separated by ';' (e.g. '512;768')")
    g.add_argument("--train_batch_size", type=int, default=1, help="images per batch (per device)")
    g.add_argument("--enable_bucket", action="store_true", help="aspect-ratio buckets")
    g.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side (with --enable_bucket)")
    g.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side (with --enable_bucket)")
    g.add_argument("--bucket_reso_steps", type=int, default=64, help="bucket side step; a multiple of 64 for SD 1.x/2.x")
    g.add_argument("--bucket_no_upscale", action="store_true", help="never enlarge an image to fill a bucket")
    g.add_argument("--caption_extension", "--caption_extention", dest="caption_extension", type=str, default=".caption",
                   help="caption file extension (default .caption; most datasets use .txt)")
    g.add_argument("--shuffle_caption", action="store_true", help="shuffle the caption's tags (after the kept ones) every time")
    g.add_argument("--caption_separator", type=str, default=",", help="tag separator of captions")
    g.add_argument("--keep_tokens", type=int, default=0, help="keep the first N tags in place when shuffling")
    g.add_argument("--keep_tokens_separator", type=str, default="", help="tags before (and after a second) separator stay in place")
    g.add_argument("--secondary_separator", type=str, default=None, help="joins tags that are shuffled as one; replaced by caption_separator")
    g.add_argument("--enable_wildcard", action="store_true", help="{a|b} choices and one random line of multi-line captions")
    g.add_argument("--caption_prefix", type=str, default=None, help="text added before every caption")
    g.add_argument("--caption_suffix", type=str, default=None, help="text added after every caption")
    g.add_argument("--color_aug", action="store_true", help="random hue/saturation/value changes (not with --cache_latents)")
    g.add_argument("--flip_aug", action="store_true", help="random horizontal flips (flipped latents are cached too)")
    g.add_argument("--face_crop_aug_range", type=str, default=None, help="e.g. '2.0,4.0'")
    g.add_argument("--random_crop", action="store_true", help="random instead of centre crop (not with --cache_latents)")
    g.add_argument("--token_warmup_min", type=int, default=1, help="tags used at the start of token warmup")
    g.add_argument("--token_warmup_step", type=float, default=0, help="steps (or a fraction < 1 of max_train_steps)")
    g.add_argument("--caption_dropout_rate", type=float, default=0.0, help="probability of training a sample with an empty caption")
    g.add_argument("--caption_dropout_every_n_epochs", type=int, default=0, help="use empty captions every N-th epoch")
    g.add_argument("--caption_tag_dropout_rate", type=float, default=0.0, help="probability of dropping each (non-kept) tag")
    g.add_argument("--prior_loss_weight", type=float, default=1.0, help="loss weight of regularization images")
    g.add_argument("--cache_latents", action="store_true", help="encode every image once before training and keep the latents in memory")
    g.add_argument("--cache_latents_to_disk", action="store_true", help="also keep them in <image>_<W>x<H>_<arch>.npz files, checked on reuse (implies --cache_latents)")
    g.add_argument("--vae_batch_size", type=int, default=1, help="images per VAE batch while caching")
    g.add_argument("--skip_cache_check", action="store_true", help="accept sd-scripts cache files (no settings signature) whose shapes match")
    g.add_argument("--max_data_loader_n_workers", type=int, default=8, help="capped at the CPU count")
    g.add_argument("--persistent_data_loader_workers", action="store_true", help="keep data-loader workers alive between epochs")
    g.add_argument("--validation_split", type=float, default=0.0, help="fraction of the images held out for validation loss")
    g.add_argument("--validation_seed", type=int, default=None, help="seed of the validation split (default: --seed)")
    g.add_argument("--alpha_mask", action="store_true", help="use the image alpha channel as the loss mask")
    g.add_argument("--masked_loss", action="store_true", help="weight the loss by the mask: conditioning_data_dir image, else <stem>-masklabel.png, else alpha")
    g.add_argument("--unmasked_probability", type=float, default=0.0,
                   help="share of samples trained without their mask (drawn per sample, per step; OneTrainer uses 0.1)")
    g.add_argument("--unmasked_weight", type=float, default=0.0,
                   help="loss weight outside the mask (0 = sd-scripts' masked loss; OneTrainer uses 0.1)")
    g.add_argument("--normalize_masked_area_loss", action="store_true",
                   help="divide each sample's loss by the mean of its mask weights, so small masks are not down-weighted")
    g.add_argument("--conditioning_data_dir", type=str, default=None, help="mask images (R channel) with the same stems")
    g.add_argument("--resize_interpolation", type=str, default=None, choices=RESIZE_INTERPOLATIONS, help="resampling filter (default: area to shrink, lanczos to enlarge)")
    g.add_argument("--resolution_schedule", type=str, default="all", choices=("all", "progressive"), help="'progressive': train several resolutions in order, low to high")
    g.add_argument("--resolution_step_fractions", type=str, default=None, help="progressive schedule, e.g. '0.3,0.7'")
    g.add_argument("--min_image_side", type=int, default=None,
                   help="skip (and name) images with a side shorter than this, in pixels (default 64, or the "
                        "smallest resolution side if smaller; 0 = no limit, as sd-scripts)")
    g.add_argument("--max_aspect_ratio", type=float, default=None,
                   help="skip (and name) images whose longer side is more than this many times the shorter "
                        "(default 8; 0 = no limit, as sd-scripts)")


def data_options_from_args(ns: argparse.Namespace, seed: Optional[int] = None) -> DataOptions:
    """The one place the argparse namespace becomes DataOptions (missing attributes keep their defaults).
    `seed`: the run's seed (drawn when --seed is not given), else the flag."""
    values = {f.name: getattr(ns, f.name) for f in fields(DataOptions) if hasattr(ns, f.name)}
    if seed is not None:
        values["seed"] = seed
    if values.get("cache_latents_to_disk") and not values.get("cache_latents"):
        logger.info("--cache_latents_to_disk implies --cache_latents")
    return DataOptions(**values)
