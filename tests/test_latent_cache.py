import dataclasses
import os

import numpy as np
import pytest
import torch

from library.data.latent_cache import (
    SETTINGS_KEY,
    CacheSettings,
    disk_cache_path,
    load_latent_cache,
    save_latent_cache,
    size_from_cache_path,
)

SETTINGS = CacheSettings(
    bucket_reso=(64, 48),
    crop_ltrb=(0, 2, 64, 46),
    flip_aug=True,
    alpha_mask=True,
    vae_id="tiny-sd-vae:fp32",
    latent_shape=(4, 6, 8),
)


def _latents(seed=0):
    return np.random.RandomState(seed).randn(4, 6, 8).astype(np.float32)


def _save(path, settings=SETTINGS, **overrides):
    kwargs = dict(
        latents=_latents(0),
        original_size=(640, 480),
        crop_ltrb=settings.crop_ltrb,
        settings=settings,
        latents_flipped=_latents(1),
        alpha_mask=np.full((48, 64), 0.5, np.float32),
    )
    kwargs.update(overrides)
    save_latent_cache(str(path), **kwargs)
    return str(path)


def test_disk_cache_path():
    assert disk_cache_path("/data/img/cat.png", (640, 480), "_sd") == "/data/img/cat_0640x0480_sd.npz"
    assert disk_cache_path("/data/a.b.jpg", (12345, 7), "_sdxl") == "/data/a.b_12345x0007_sdxl.npz"
    assert size_from_cache_path("/data/img/cat_0640x0480_sd.npz") == (640, 480)
    assert size_from_cache_path("/data/img/cat.npz") is None


def test_signature_is_stable_json():
    assert SETTINGS.signature() == (
        '{"alpha_mask":true,"bucket_reso":[64,48],"crop_ltrb":[0,2,64,46],"flip_aug":true,'
        '"latent_shape":[4,6,8],"random_crop":false,"vae_id":"tiny-sd-vae:fp32"}'
    )


def test_round_trip_with_sd_scripts_keys(tmp_path):
    path = _save(tmp_path / "cat_0640x0480_sd.npz", latents=torch.from_numpy(_latents(0)).half().float())
    with np.load(path) as data:
        assert sorted(data.files) == sorted(
            ["latents", "original_size", "crop_ltrb", "latents_flipped", "alpha_mask", SETTINGS_KEY]
        )
        assert data["latents"].dtype == np.float32
        assert data["original_size"].tolist() == [640, 480]
        assert data["crop_ltrb"].tolist() == [0, 2, 64, 46]
    entry = load_latent_cache(path, SETTINGS)
    assert entry is not None
    assert np.array_equal(entry.latents, torch.from_numpy(_latents(0)).half().float().numpy())
    assert np.array_equal(entry.latents_flipped, _latents(1))
    assert entry.alpha_mask.shape == (48, 64) and float(entry.alpha_mask[0, 0]) == 0.5
    assert entry.original_size == (640, 480) and entry.crop_ltrb == (0, 2, 64, 46)


def test_atomic_write_leaves_no_temp_files(tmp_path):
    _save(tmp_path / "a_0640x0480_sd.npz")
    _save(tmp_path / "a_0640x0480_sd.npz")  # overwrite in place
    assert os.listdir(tmp_path) == ["a_0640x0480_sd.npz"]


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = _save(tmp_path / "a_0640x0480_sd.npz")

    def half_write(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", half_write)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path / "a_0640x0480_sd.npz", latents=_latents(5))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["a_0640x0480_sd.npz"]
    assert load_latent_cache(path, SETTINGS) is not None


@pytest.mark.parametrize(
    "change",
    [
        {"bucket_reso": (48, 64), "latent_shape": (4, 6, 8)},
        {"crop_ltrb": (0, 0, 64, 48)},
        {"vae_id": "other-vae:fp16"},
        {"latent_shape": (4, 8, 8)},
        {"random_crop": True},
        # a cache written before each image's posterior sample came from its own seed (no "posterior" key)
        {"posterior": "per-image seed (sha256 of the pixels)"},
    ],
)
def test_different_settings_are_stale(tmp_path, change):
    path = _save(tmp_path / "a.npz")
    assert load_latent_cache(path, dataclasses.replace(SETTINGS, **change)) is None


def test_stale_file_contents(tmp_path):
    assert load_latent_cache(str(tmp_path / "missing.npz"), SETTINGS) is None
    # wrong latent shape under a matching signature (e.g. written by a buggy tool)
    assert load_latent_cache(_save(tmp_path / "shape.npz", latents=np.zeros((4, 8, 8), np.float32)), SETTINGS) is None
    # flip_aug on but no flipped latents
    assert load_latent_cache(_save(tmp_path / "noflip.npz", latents_flipped=None), SETTINGS) is None
    # alpha_mask on but no mask, or a mask of the wrong size
    assert load_latent_cache(_save(tmp_path / "nomask.npz", alpha_mask=None), SETTINGS) is None
    assert load_latent_cache(_save(tmp_path / "badmask.npz", alpha_mask=np.ones((64, 48))), SETTINGS) is None
    # NaN latents are never reused
    bad = _latents(0)
    bad[0, 0, 0] = np.nan
    assert load_latent_cache(_save(tmp_path / "nan.npz", latents=bad), SETTINGS) is None


def test_flipped_and_mask_not_needed_when_off(tmp_path):
    plain = dataclasses.replace(SETTINGS, flip_aug=False, alpha_mask=False)
    path = _save(tmp_path / "plain.npz", settings=plain, latents_flipped=None, alpha_mask=None)
    entry = load_latent_cache(path, plain)
    assert entry is not None and entry.latents_flipped is None and entry.alpha_mask is None


def test_damaged_files_return_none(tmp_path):
    good = _save(tmp_path / "good.npz")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(open(good, "rb").read()[:500])
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    junk = tmp_path / "junk.npz"
    junk.write_text("not a zip")
    for path in (truncated, empty, junk):
        assert load_latent_cache(str(path), SETTINGS) is None


def _save_foreign(path, latents_shape=(4, 6, 8)):
    """A file as sd-scripts writes it: its keys, no settings signature, float crop box."""
    np.savez(
        path,
        latents=np.zeros(latents_shape, np.float32),
        original_size=np.array([640, 480]),
        crop_ltrb=np.array([0.0, 2.0, 64.0, 46.0]),
        latents_flipped=np.zeros(latents_shape, np.float32),
        alpha_mask=np.ones((48, 64), np.float32),
    )
    return str(path)


def test_foreign_file_is_stale_unless_accepted(tmp_path):
    path = _save_foreign(tmp_path / "cat_0640x0480_sd.npz")
    assert load_latent_cache(path, SETTINGS) is None
    entry = load_latent_cache(path, SETTINGS, accept_foreign=True)
    assert entry is not None and entry.crop_ltrb == (0, 2, 64, 46)
    wrong = _save_foreign(tmp_path / "dog_0640x0480_sd.npz", latents_shape=(4, 8, 6))
    assert load_latent_cache(wrong, SETTINGS, accept_foreign=True) is None


def test_flux_style_keys_carry_the_latent_size_and_keep_other_resolutions(tmp_path):
    from library.data.latent_cache import latent_key_suffix

    assert latent_key_suffix((64, 48), None) == ""
    assert latent_key_suffix((512, 768), 8) == "_96x64"  # (width, height) bucket -> _<h>x<w> latent size
    path = str(tmp_path / "cat_0640x0480_flux.npz")
    _save(path, key_suffix="_6x8")
    small = dataclasses.replace(SETTINGS, bucket_reso=(32, 24), crop_ltrb=(0, 1, 32, 23), latent_shape=(4, 3, 4))
    save_latent_cache(path, np.ones((4, 3, 4), np.float32), (640, 480), small.crop_ltrb, small,
                      np.zeros((4, 3, 4), np.float32), np.ones((24, 32), np.float32), key_suffix="_3x4")
    with np.load(path) as data:
        assert sorted(data.files) == sorted(f"{k}_{s}" for k in ("latents", "latents_flipped", "original_size",
                                                                 "crop_ltrb", "alpha_mask", SETTINGS_KEY)
                                            for s in ("6x8", "3x4"))
    big = load_latent_cache(path, SETTINGS, key_suffix="_6x8")
    np.testing.assert_array_equal(big.latents, _latents(0))
    assert big.crop_ltrb == (0, 2, 64, 46)
    assert load_latent_cache(path, small, key_suffix="_3x4").latents.sum() == 48
    assert load_latent_cache(path, SETTINGS) is None  # unsuffixed keys are not there
    assert load_latent_cache(path, small, key_suffix="_6x8") is None  # wrong size under that suffix
