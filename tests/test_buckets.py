import pytest

from library.core.errors import ConfigError, DataError
from library.data.buckets import (
    BucketManager,
    ImageTooSmallError,
    adjust_min_max_to_steps,
    check_fixed_resolution,
    make_bucket_resolutions,
    validate_bucket_settings,
)

SD_512_BUCKETS = [
    (256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768),
    (384, 640), (448, 576), (512, 512), (576, 448), (640, 384), (704, 320),
    (768, 320), (832, 256), (896, 256), (960, 256), (1024, 256),
]


def test_bucket_list_for_512_matches_sd_scripts():
    assert make_bucket_resolutions((512, 512), 256, 1024, 64) == SD_512_BUCKETS


def test_bucket_list_for_1024_with_steps_of_64():
    buckets = make_bucket_resolutions((1024, 1024), 640, 1536, 64)
    # widths 704 and 1408 (and 768/1280) both yield a pair, so near-duplicates appear, as in sd-scripts
    assert buckets == [
        (640, 1536), (704, 1408), (704, 1472), (768, 1280), (768, 1344), (832, 1216), (896, 1152),
        (960, 1088), (1024, 1024), (1088, 960), (1152, 896), (1216, 832), (1280, 768), (1344, 768),
        (1408, 704), (1472, 704), (1536, 640),
    ]
    assert all(w * h <= 1024 * 1024 for w, h in buckets)


def test_bucket_list_non_square_resolution_keeps_area():
    buckets = make_bucket_resolutions((768, 512), 256, 1024, 64)
    # sqrt(768*512) = 627.1 -> square bucket 576
    assert (576, 576) in buckets
    assert all(w * h <= 768 * 512 for w, h in buckets)
    assert buckets == sorted(buckets)


@pytest.fixture
def manager():
    m = BucketManager(False, (512, 512), 256, 1024, 64)
    m.make_buckets()
    return m


@pytest.mark.parametrize(
    "size, bucket, resized, ar_error",
    [
        ((1000, 600), (640, 384), (640, 384), 0.0),
        ((600, 1000), (384, 640), (384, 640), 0.0),
        ((512, 512), (512, 512), (512, 512), 0.0),  # exact match
        ((1024, 1024), (512, 512), (512, 512), 0.0),
        ((1200, 800), (640, 384), (640, 427), 640 / 384 - 1.5),  # wider than 1.5: match width
        ((4000, 100), (1024, 256), (10240, 256), 4.0 - 40.0),  # extreme: the widest bucket
        ((100, 4000), (256, 1024), (256, 10240), 0.25 - 0.025),
        ((704, 320), (704, 320), (704, 320), 0.0),
    ],
)
def test_select_bucket(manager, size, bucket, resized, ar_error):
    got_bucket, got_resized, got_error = manager.select_bucket(*size)
    assert got_bucket == bucket
    assert got_resized == resized
    assert got_error == pytest.approx(ar_error)
    assert got_resized[0] >= bucket[0] and got_resized[1] >= bucket[1]


def test_exact_predefined_size_wins_over_aspect(manager):
    manager.set_predefined_resos([(512, 512), (500, 500)])
    assert manager.select_bucket(500, 500)[0] == (500, 500)
    # a non-member of the same aspect takes the first of the tied buckets
    assert manager.select_bucket(600, 600) == ((512, 512), (512, 512), 0.0)


@pytest.mark.parametrize(
    "size, bucket, resized",
    [
        ((300, 200), (256, 192), (300, 200)),  # small: kept, bucket floored to steps
        ((64, 64), (64, 64), (64, 64)),
        ((512, 512), (512, 512), (512, 512)),
        ((1000, 1000), (512, 512), (512, 512)),  # big: shrunk to the area
        ((1000, 600), (640, 384), (640, 384)),
        ((1000, 700), (576, 384), (576, 403)),  # rounding the width loses less aspect
        ((2000, 500), (1024, 256), (1024, 256)),
        ((4000, 100), (2560, 64), (2560, 64)),  # min/max are ignored
    ],
)
def test_no_upscale(size, bucket, resized):
    m = BucketManager(True, (512, 512), None, None, 64)
    got_bucket, got_resized, _ = m.select_bucket(*size)
    assert (got_bucket, got_resized) == (bucket, resized)


def test_no_upscale_image_smaller_than_a_step_is_a_data_error():
    m = BucketManager(True, (512, 512), None, None, 64)
    with pytest.raises(ImageTooSmallError, match="40x300") as info:
        m.select_bucket(40, 300)
    assert isinstance(info.value, DataError)


def test_assign_counts_repeats_and_bucket_info(manager):
    manager.assign("a", 1000, 600, repeats=3)
    manager.assign("b", 512, 512)
    manager.assign("c", 600, 1000, repeats=2)
    manager.assign("d", 1200, 800)
    manager.sort()
    assert manager.resos == [(384, 640), (512, 512), (640, 384)]
    assert manager.buckets == [["c", "c"], ["b"], ["a", "a", "a", "d"]]
    info = manager.bucket_info()
    assert info["buckets"] == {
        0: {"resolution": [384, 640], "count": 2},
        1: {"resolution": [512, 512], "count": 1},
        2: {"resolution": [640, 384], "count": 4},
    }
    # one error per image, not per repeat: (0 + 0 + 0 + 1/6) / 4
    assert info["mean_img_ar_error"] == pytest.approx((640 / 384 - 1.5) / 4)


def test_add_image_after_select(manager):
    reso, _, err = manager.select_bucket(600, 1000)
    manager.add_image(reso, 7)
    manager.record_ar_error(err)
    assert manager.bucket_info() == {"buckets": {0: {"resolution": [384, 640], "count": 1}}, "mean_img_ar_error": 0.0}


def test_adjust_min_max_to_steps():
    assert adjust_min_max_to_steps(300, 1000, 64) == (256, 1024)
    assert adjust_min_max_to_steps(256, 1024, 64) == (256, 1024)


def test_validate_bucket_settings_accepts_defaults():
    validate_bucket_settings(512, 256, 1024, 64, 64, "dataset.toml: datasets[0]")
    validate_bucket_settings((768, 512), 300, 1000, 64, 64, "dataset.toml: datasets[0]")


@pytest.mark.parametrize(
    "args, message",
    [
        ((512, 256, 1024, 32, 64), "dataset.toml: datasets[0]: bucket_reso_steps: expected a multiple of 64 for this model, got 32"),
        ((512, 576, 1024, 64, 64), "dataset.toml: datasets[0]: min_bucket_reso: expected at most the smaller resolution side 512, got 576 (rounded to steps of 64: 576)"),
        ((1024, 256, 960, 64, 64), "dataset.toml: datasets[0]: max_bucket_reso: expected at least the larger resolution side 1024, got 960 (rounded to steps of 64: 960)"),
        ((512, 256, 1024, 0, 64), "dataset.toml: datasets[0]: bucket_reso_steps: expected an integer >= 1, got 0"),
        ((512, 1024, 256, 64, 64), "dataset.toml: datasets[0]: min_bucket_reso 1024 is larger than max_bucket_reso 256"),
    ],
)
def test_validate_bucket_settings_errors(args, message):
    with pytest.raises(ConfigError) as info:
        validate_bucket_settings(*args, where="dataset.toml: datasets[0]")
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_max_rounded_up_to_steps_makes_resolution_fit():
    # 1000 rounds up to 1024, so 1024 is allowed, as in sd-scripts
    validate_bucket_settings(1024, 256, 1000, 64, 64, "x")


def test_check_fixed_resolution():
    assert check_fixed_resolution((512, 512), (512, 512), False) is None
    assert check_fixed_resolution((600, 512), (512, 512), True) is None
    assert check_fixed_resolution((600, 512), (512, 512), False) == (
        "image is 600x512, larger than the resolution 512x512; set enable_bucket = true or random_crop = true"
    )
    assert check_fixed_resolution((500, 800), (512, 512), True) == (
        "image is 500x800, smaller than the resolution 512x512; enlarge it or set enable_bucket = true"
    )
