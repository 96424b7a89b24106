"""DataOptions: the dataset flags in typed form (built from flags in library/cli/dataset.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

RESIZE_INTERPOLATIONS = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area", "box")


@dataclass
class DataOptions:
    """Every dataset flag. Values here are the CLI layer of the precedence
    subset > dataset > general > CLI > default; the dataclass defaults are the sd-scripts defaults."""
    train_data_dir: Optional[str] = None
    reg_data_dir: Optional[str] = None
    in_json: Optional[str] = None
    dataset_config: Optional[str] = None
    dataset_repeats: int = 1
    resolution: Optional[str] = None  # "512", "512,768" (width,height) or several: "512;768"
    train_batch_size: int = 1
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    keep_bucket_order: bool = False  # extension: no shuffle inside a bucket (plan_epoch)
    caption_extension: str = ".caption"
    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    secondary_separator: Optional[str] = None
    enable_wildcard: bool = False
    caption_prefix: Optional[str] = None
    caption_suffix: Optional[str] = None
    color_aug: bool = False
    flip_aug: bool = False
    face_crop_aug_range: Optional[str] = None  # "2.0,4.0"
    random_crop: bool = False
    token_warmup_min: int = 1
    token_warmup_step: float = 0
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    prior_loss_weight: float = 1.0
    cache_latents: bool = False
    cache_latents_to_disk: bool = False
    vae_batch_size: int = 1
    skip_cache_check: bool = False
    max_data_loader_n_workers: int = 8
    persistent_data_loader_workers: bool = False
    validation_split: float = 0.0
    validation_seed: Optional[int] = None
    alpha_mask: bool = False
    masked_loss: bool = False
    unmasked_probability: float = 0.0  # OneTrainer-style masked training (docs/dataset_config.md "Masks")
    unmasked_weight: float = 0.0
    normalize_masked_area_loss: bool = False
    conditioning_data_dir: Optional[str] = None
    # Set by the control scripts (ControlNet, LLLite), not a flag: conditioning_data_dir holds RGB conditioning
    # images, paired with each image and put in the batch as "conditioning_images" (docs/controlnet.md).
    conditioning_images: bool = False
    resize_interpolation: Optional[str] = None
    resolution_schedule: str = "all"  # extension: "all" or "progressive"
    resolution_step_fractions: Optional[str] = None  # extension: "0.3,0.7"
    min_image_side: Optional[int] = None  # extension: skip smaller images (None: the dataset default, 64 px)
    max_aspect_ratio: Optional[float] = None  # extension: skip longer/shorter side beyond it (None: 8; 0: no limit)
    seed: Optional[int] = None  # added to the parser by the training args, not here

    def __post_init__(self) -> None:
        # --cache_latents_to_disk implies --cache_latents, as in sd-scripts (alone it used to cache nothing).
        if self.cache_latents_to_disk:
            self.cache_latents = True

    def data_loader_workers(self) -> int:
        """--max_data_loader_n_workers capped at the CPU count (0 = load in the main process)."""
        return max(0, min(self.max_data_loader_n_workers, os.cpu_count() or 1))

