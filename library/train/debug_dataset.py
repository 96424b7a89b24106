"""--debug_dataset: print the batches of the first epoch as training would load them (captions after shuffling,
dropout and wildcards, bucket, crop, flip, loss weight, mask), without loading the model or training; with
--debug_dataset_dir (this toolkit) also write each batch's images as PNG files to look at (sd-scripts shows them
in an OpenCV window, which a headless machine does not have)."""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np
from PIL import Image

from library.core.io_utils import atomic_path


def print_batches(data, epoch: int = 1, out: Callable[[str], None] = print, image_dir: Optional[str] = None,
                  max_batches: Optional[int] = None) -> int:
    """Print every batch of `epoch` (a TrainingData planned for the run); returns the number of batches."""
    refs = data.epoch_batches(epoch, 0)
    if max_batches is not None:
        refs = refs[:max_batches]
    for ref in refs:
        batch = data.load_batch(ref)
        out(f"epoch {ref.epoch} batch {ref.index + 1}/{len(refs)} step {ref.step + 1}: bucket {ref.bucket[0]}x"
            f"{ref.bucket[1]}, {len(batch.get('image_paths', []))} image(s)")
        for i, path in enumerate(batch.get("image_paths", [])):
            crop = tuple(batch["crop_top_lefts"][i].tolist())
            size = tuple(batch["original_sizes_hw"][i].tolist())
            mask = batch.get("masks")
            preserve = batch.get("diff_output_preservation")
            out(f"  {path}: original {size[1]}x{size[0]}, crop top-left {crop}, loss weight "
                f"{float(batch['loss_weights'][i]):g}"
                + (", masked" if mask is not None else "")
                + (", output preservation" if preserve is not None and bool(preserve[i]) else ""))
            out(f"    caption: {batch['captions'][i]}")
            if image_dir and batch.get("images") is not None:
                _write_image(batch["images"][i], os.path.join(image_dir, f"e{ref.epoch}_b{ref.index + 1:04d}_{i}.png"))
        for path in batch.get("skipped_images", []):
            out(f"  {path}: skipped (cannot be decoded)")
    return len(refs)


def _write_image(image, path: str) -> None:
    """A (3, H, W) tensor in [-1, 1] as an 8-bit PNG."""
    array = ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    with atomic_path(path) as tmp:
        Image.fromarray(np.ascontiguousarray(array)).save(tmp, format="PNG")
