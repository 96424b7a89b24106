"""Conditioning images (conditioning_data_dir for the ControlNet / LLLite scripts): paired, cropped and flipped with
their image, in the batch as 0..1 pixels; missing or mismatched pairs named before step 1."""

import os

import numpy as np
import pytest
from PIL import Image

from library.core.errors import ConfigError, DataError
from library.data import DataFamilyInfo, build_training_data
from library.data.options import DataOptions

FAMILY = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8, latent_channels=4)
PIXELS = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_px", vae_scale_factor=1, latent_channels=3)


def _noise_image(w, h, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def _pairs(root, sizes, cond_sizes=None, skip=()):
    """root/train/1_toy/im<i>.png and root/cond/im<i>.png: the conditioning image is the image's own pixels
    (resized to cond_sizes[i] when given), so after loading the two must agree pixel for pixel."""
    folder, cond = os.path.join(root, "train", "1_toy"), os.path.join(root, "cond")
    os.makedirs(folder, exist_ok=True)
    os.makedirs(cond, exist_ok=True)
    for i, (w, h) in enumerate(sizes):
        img = _noise_image(w, h, i)
        Image.fromarray(img).save(os.path.join(folder, f"im{i}.png"))
        with open(os.path.join(folder, f"im{i}.txt"), "w") as f:
            f.write(f"toy {i}")
        if i in skip:
            continue
        c = Image.fromarray(img)
        if cond_sizes and cond_sizes[i] != (w, h):
            c = c.resize(cond_sizes[i])
        c.save(os.path.join(cond, f"im{i}.png"))
    return os.path.join(root, "train"), cond


def _opts(train, cond, **kw):
    base = dict(train_data_dir=train, conditioning_data_dir=cond, conditioning_images=True, resolution="64",
                caption_extension=".txt", seed=3, train_batch_size=1)
    base.update(kw)
    return DataOptions(**base)


def _batches(data, epochs):
    data.plan(1000, 1)
    for epoch in range(1, epochs + 1):
        for ref in data.epoch_batches(epoch, 0):
            yield data.load_batch(ref)


def _as_uint8(images, unit):
    """Both batch tensors back to 0..255 integers (images: -1..1, conditioning: 0..1)."""
    return ((images + 1) * 127.5).round().to(dtype=int), (unit * 255).round().to(dtype=int)


@pytest.mark.parametrize("bucket", [False, True])
def test_conditioning_image_is_cropped_and_flipped_with_its_image(tmp_path, bucket):
    # 96x64 and 64x96 images at 64x64: random crop moves the window, flip_aug mirrors; the pair must move together.
    train, cond = _pairs(str(tmp_path), [(96, 64), (64, 96)])
    extra = dict(enable_bucket=True, min_bucket_reso=64, max_bucket_reso=64) if bucket else {}
    data = build_training_data(_opts(train, cond, random_crop=True, flip_aug=True, **extra), FAMILY)
    assert [os.path.basename(s.conditioning_path) for s in data.samples] == ["im0.png", "im1.png"]
    assert all(s.mask_path is None for s in data.samples)
    crops, n = set(), 0
    for batch in _batches(data, 12):
        images, conds = _as_uint8(batch["images"], batch["conditioning_images"])
        assert conds.shape == (1, 3, 64, 64) and batch["conditioning_images"].dtype.is_floating_point
        assert 0.0 <= batch["conditioning_images"].min() and batch["conditioning_images"].max() <= 1.0
        assert (images == conds).all(), "conditioning image not cropped/flipped as its image"
        crops.add(tuple(images[0, 0, 0, :4].tolist()) + tuple(images[0, 0, :4, 0].tolist()))
        n += 1
    assert n == 24 and len(crops) >= 6  # different crops and flips were drawn (measured: 20 of 24 distinct)


def test_cached_latents_still_get_the_conditioning_image(tmp_path):
    train, cond = _pairs(str(tmp_path), [(96, 64)])
    data = build_training_data(_opts(train, cond, flip_aug=True, cache_latents=True, enable_bucket=True, min_bucket_reso=64,
                                     max_bucket_reso=64), PIXELS)
    # A stand-in encoder: the "latent" is the image itself, so the pair can be compared after a cached load.
    data.cache_latents(lambda px: px.clone(), "identity", False, 1, 0)
    flips = set()
    for batch in _batches(data, 6):
        assert batch["images"] is None and batch["latents"] is not None
        images, conds = _as_uint8(batch["latents"], batch["conditioning_images"])
        assert (images == conds).all()
        flips.add(tuple(images[0, 0, 0, :8].tolist()))
    assert len(flips) == 2  # both the flipped and the unflipped cached latent were used


def test_missing_unreadable_and_mismatched_pairs_are_named_before_training(tmp_path):
    train, cond = _pairs(str(tmp_path), [(64, 64), (64, 64), (64, 64)], cond_sizes=[(64, 64), (64, 64), (32, 32)],
                         skip=(1,))
    folder = os.path.join(train, "1_toy")
    with pytest.raises(DataError) as e:
        build_training_data(_opts(train, cond, enable_bucket=True, min_bucket_reso=64, max_bucket_reso=64), FAMILY)
    assert str(e.value).splitlines() == [
        "2 problems in the training data; fix them and start again:",
        f"  {folder}/im1.png: no conditioning image with the same name in {cond}",
        f"  {cond}/im2.png: conditioning image is 32x32 but its image {folder}/im2.png is 64x64; expected the same "
        "size (with enable_bucket)"]
    # Without buckets sd-scripts resizes the conditioning image: so does this (to the image's size, then cropped).
    os.remove(os.path.join(folder, "im1.png"))
    data = build_training_data(_opts(train, cond), FAMILY)
    batch = next(b for b in _batches(data, 1) if b["image_paths"][0].endswith("im2.png"))
    assert batch["conditioning_images"].shape == (1, 3, 64, 64)
    # An unreadable conditioning image skips its image with the reason, as an unreadable image does.
    with open(os.path.join(cond, "im2.png"), "wb") as f:
        f.write(b"not a png")
    data = build_training_data(_opts(train, cond), FAMILY)
    assert [os.path.basename(s.path) for s in data.samples] == ["im0.png"]


def test_control_subsets_need_conditioning_data_dir_and_no_masks(tmp_path):
    train, cond = _pairs(str(tmp_path), [(64, 64)])
    with pytest.raises(ConfigError) as e:
        build_training_data(_opts(train, None, masked_loss=True), FAMILY)
    assert str(e.value).splitlines() == [
        "--train_data_dir 1_toy: needs conditioning_data_dir (a folder of conditioning images with the images' names; "
        "--conditioning_data_dir or the subset key)",
        "--train_data_dir 1_toy: masked_loss: conditioning_data_dir holds the conditioning images here, not masks; "
        "drop masked_loss"]
    # Without the control scripts' switch the folder is still the masked-loss mask folder.
    with pytest.raises(ConfigError, match="conditioning_data_dir \\(mask images\\) needs --masked_loss"):
        build_training_data(_opts(train, cond, conditioning_images=False), FAMILY)
