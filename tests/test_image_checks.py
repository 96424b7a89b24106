"""Every image is decode-checked during the dataset scan; unusable ones (truncated, too small, too elongated,
broken symbolic links) are skipped and named in one warning before training."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from PIL import Image

from library.core.errors import ConfigError
from library.data import DataFamilyInfo, build_training_data, image_scan
from library.data.image_scan import scan_image_sizes
from library.data.options import DataOptions

FAMILY = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8, latent_channels=4)


def png(path, size=(64, 64), noise=False) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if noise:
        pixels = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
    else:
        Image.new("RGB", size, (200, 100, 50)).save(path)
    return str(path)


def truncated_png(path) -> str:
    png(path, (96, 96), noise=True)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) * 6 // 10])  # the header (and size) reads, the pixels do not
    return str(path)


def truncated_jpeg(path) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pixels = np.random.default_rng(1).integers(0, 255, (300, 400, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) * 7 // 10])
    return str(path)


def opts(train_dir, **kw) -> DataOptions:
    base = dict(train_data_dir=str(train_dir), resolution="64", enable_bucket=True, min_bucket_reso=64,
                max_bucket_reso=128, caption_extension=".txt", seed=1, max_data_loader_n_workers=0)
    base.update(kw)
    return DataOptions(**base)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))


def _skip_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipped, not trained" in r.getMessage()]


def test_truncated_tiny_and_elongated_images_are_skipped_and_named_once(tmp_path, caplog, cache_dir):
    """A truncated PNG (header fine), a 1x1 image and a 20000x10 image are skipped at the scan, each
    named with its reason in one warning, and kept on the data object for the final report."""
    train = tmp_path / "train" / "3_x"
    good = [png(train / f"good{i}.png") for i in range(2)]
    bad = {
        truncated_png(train / "truncated.png"): "cannot decode image: ",
        truncated_jpeg(train / "truncated.jpg"): "cannot decode image: image file is truncated",
        png(train / "one.png", (1, 1)): "image is 1x1, a side shorter than min_image_side 64 px",
        png(train / "strip.png", (20000, 10)): "image is 20000x10, a side shorter than min_image_side 64 px",
        png(train / "long.png", (1100, 128)): "image is 1100x128, aspect ratio 8.59:1 beyond max_aspect_ratio 8",
    }
    assert Image.open(next(iter(bad))).size == (96, 96)  # the header check alone would pass it
    with caplog.at_level(logging.WARNING):
        data = build_training_data(opts(tmp_path / "train"), FAMILY)
    assert sorted(s.path for s in data.samples) == sorted(good)
    assert sorted(data.skipped_images) == sorted(bad)
    for path, why in bad.items():
        assert data.skipped_images[path].startswith(why), (path, data.skipped_images[path])
    warnings = _skip_warnings(caplog)
    assert len(warnings) == 1
    lines = warnings[0].splitlines()
    assert lines[0] == "5 image file(s) skipped, not trained:"
    assert sorted(line.strip() for line in lines[1:]) == sorted(f"{p}: {w}" for p, w in data.skipped_images.items())


def test_aspect_limit_alone_and_both_limits_off_as_sd_scripts(tmp_path, cache_dir):
    """A wide image with enough pixels is skipped for its aspect ratio alone; min_image_side = 0 and
    max_aspect_ratio = 0 restore sd-scripts' behaviour (everything that decodes trains)."""
    train = tmp_path / "train" / "1_x"
    png(train / "a.png")
    wide = png(train / "wide.png", (1200, 64))
    tiny = png(train / "tiny.png", (8, 8))
    data = build_training_data(opts(tmp_path / "train"), FAMILY)
    assert data.skipped_images[wide].startswith("image is 1200x64, aspect ratio 18.8:1 beyond max_aspect_ratio 8")
    data = build_training_data(opts(tmp_path / "train", min_image_side=0, max_aspect_ratio=0), FAMILY)
    assert data.skipped_images == {} and {wide, tiny} <= {s.path for s in data.samples}


def test_min_side_is_capped_by_the_smallest_resolution(tmp_path, cache_dir):
    """min_image_side (default 64) never exceeds the training resolution: a 48 px image trains at
    resolution 48, and --min_image_side raises the limit."""
    train = tmp_path / "train" / "1_x"
    small = png(train / "small.png", (48, 48))
    data = build_training_data(opts(tmp_path / "train", resolution="48", enable_bucket=False), FAMILY)
    assert [s.path for s in data.samples] == [small]
    png(train / "big.png", (128, 128))
    data = build_training_data(opts(tmp_path / "train", min_image_side=100), FAMILY)
    assert data.skipped_images == {small: "image is 48x48, a side shorter than min_image_side 64 px (set "
                                          "min_image_side = 0 to train it anyway, as sd-scripts does)"}


def test_symlink_loop_and_dangling_links_are_named(tmp_path, caplog, cache_dir):
    """Image links that loop or point nowhere, and an N_name folder link that points nowhere, are
    named in the skip warning instead of disappearing."""
    root = tmp_path / "train"
    train = root / "2_x"
    png(train / "a.png")
    os.symlink(str(train / "gone.png"), str(train / "dangling.png"))
    os.symlink(str(train / "loop2.png"), str(train / "loop1.png"))
    os.symlink(str(train / "loop1.png"), str(train / "loop2.png"))
    os.symlink(str(tmp_path / "elsewhere"), str(root / "5_gone"))
    with caplog.at_level(logging.WARNING):
        data = build_training_data(opts(root), FAMILY)
    skipped = data.skipped_images
    assert skipped[str(train / "dangling.png")] == f"dangling symbolic link (its target {train / 'gone.png'} does not exist)"
    assert skipped[str(train / "loop1.png")].startswith("symbolic link loop (loop1.png -> ")
    assert skipped[str(train / "loop2.png")].startswith("symbolic link loop (loop2.png -> ")
    assert skipped[str(root / "5_gone")].startswith("dangling symbolic link")
    assert len(_skip_warnings(caplog)) == 1 and "loop1.png" in _skip_warnings(caplog)[0]


def test_decode_result_is_cached_by_path_mtime_and_size(tmp_path, monkeypatch):
    """A second scan decodes nothing (the truncated file's problem comes from the cache); the scan
    runs on a thread pool."""
    paths = [truncated_png(tmp_path / "t.png"), png(tmp_path / "g.png")]
    cache = str(tmp_path / "sizes.json")
    first = scan_image_sizes(paths, cache, progress=False)
    assert list(first.problems) == [paths[0]] and first.problems[paths[0]].startswith("cannot decode image")

    def no_open(*args, **kwargs):
        raise AssertionError("a cached answer was decoded again")

    monkeypatch.setattr(image_scan.Image, "open", no_open)
    second = scan_image_sizes(paths, cache, progress=False)
    assert second.problems == first.problems and second.sizes == first.sizes and second.from_cache == 2


def test_limits_are_dataset_toml_keys_checked_like_the_others(tmp_path, cache_dir):
    """min_image_side / max_aspect_ratio in [general] or [[datasets]], with a one-line error for a bad value."""
    train = tmp_path / "img"
    png(train / "a.png")
    wide = png(train / "wide.png", (640, 64))
    cfg = tmp_path / "ds.toml"
    cfg.write_text(f'[general]\nresolution = 64\nenable_bucket = true\nmin_bucket_reso = 64\nmax_bucket_reso = 128\n'
                   f'[[datasets]]\nmax_aspect_ratio = 4\n[[datasets.subsets]]\nimage_dir = "{train}"\n')
    data = build_training_data(DataOptions(dataset_config=str(cfg), seed=1), FAMILY)
    assert list(data.skipped_images) == [wide]
    cfg.write_text(f'[general]\nresolution = 64\nmax_aspect_ratio = 0.5\n[[datasets]]\n[[datasets.subsets]]\n'
                   f'image_dir = "{train}"\n')
    with pytest.raises(ConfigError, match=r"general.max_aspect_ratio: expected a number >= 1 .*or 0 for no limit, got 0.5"):
        build_training_data(DataOptions(dataset_config=str(cfg), seed=1), FAMILY)


def test_skipped_images_are_named_before_step_one(tmp_path, caplog, cache_dir):
    """In a real run the skip warning comes before the model loads and before the first step."""
    from tests.train_helpers import base_args, make_dataset, make_trainer

    data_dir = make_dataset(str(tmp_path), n=1)
    broken = truncated_png(os.path.join(data_dir, "5_sks toy", "broken.png"))
    trainer = make_trainer(base_args(data_dir, str(tmp_path / "out"), steps=1))
    with caplog.at_level(logging.INFO):
        trainer.run()
    messages = [r.getMessage() for r in caplog.records]
    skip_at = next(i for i, m in enumerate(messages) if "skipped, not trained" in m and broken in m)
    train_at = next(i for i, m in enumerate(messages) if m.startswith("training:"))
    assert skip_at < train_at
    assert trainer.data.skipped_images[broken].startswith("cannot decode image")
