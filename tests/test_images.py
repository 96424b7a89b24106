import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from library.core.errors import ConfigError, DataError
from library.data.images import (
    FaceBox,
    ImageDecodeError,
    apply_orientation,
    color_augment,
    crop_ltrb_for,
    face_crop,
    flip_crop_ltrb,
    flip_horizontal,
    is_image_file,
    load_image,
    parse_face_box,
    random_crop_to,
    resize_and_crop,
    resize_and_crop_with_mask,
    resize_image,
    to_tensor,
    validate_interpolation,
)


def save(img: Image.Image, path, **kwargs) -> str:
    img.save(path, **kwargs)
    return str(path)


# ---- loading: every mode ends as (H, W, 3) uint8 RGB -------------------------------------------


def test_palette_with_transparency(tmp_path):
    img = Image.new("P", (2, 1))
    img.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    img.putdata([0, 1])
    path = save(img, tmp_path / "p.png", transparency=0)
    rgb, alpha = load_image(path, with_alpha=True)
    assert rgb.shape == (1, 2, 3) and rgb.dtype == np.uint8
    assert rgb.tolist() == [[[255, 0, 0], [0, 0, 255]]]
    assert alpha.dtype == np.float32 and alpha.tolist() == [[0.0, 1.0]]
    rgb, alpha = load_image(path)
    assert alpha is None
    assert rgb.tolist() == [[[255, 255, 255], [0, 0, 255]]]  # transparent red -> white


def test_la_image(tmp_path):
    img = Image.new("LA", (1, 1), (100, 128))
    path = save(img, tmp_path / "la.png")
    rgb, alpha = load_image(path, with_alpha=True)
    assert rgb.tolist() == [[[100, 100, 100]]]
    assert alpha[0, 0] == pytest.approx(128 / 255)
    rgb, _ = load_image(path)
    assert rgb.tolist() == [[[177, 177, 177]]]  # 100 * 128/255 + 255 * 127/255 = 177.2


def test_grey_and_one_bit(tmp_path):
    rgb, alpha = load_image(save(Image.new("L", (3, 2), 77), tmp_path / "l.png"), with_alpha=True)
    assert rgb.shape == (2, 3, 3) and np.all(rgb == 77)
    assert alpha.tolist() == [[1.0] * 3] * 2  # no transparency: all ones
    one_bit = Image.new("1", (2, 1))
    one_bit.putdata([0, 1])
    rgb, _ = load_image(save(one_bit, tmp_path / "b.png"))
    assert rgb.tolist() == [[[0, 0, 0], [255, 255, 255]]]


def test_16_bit_grey_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 257, 1000, 32768, 65278, 65535]], dtype=np.uint16)
    path = save(Image.fromarray(values), tmp_path / "g16.png")
    assert Image.open(path).mode == "I;16"
    rgb, _ = load_image(path)
    assert rgb[:, :, 0].tolist() == [[0, 1, 4, 128, 254, 255]]
    assert np.all(rgb[:, :, 0] == rgb[:, :, 2])


def test_32_bit_int_mode(tmp_path):
    values = np.array([[0, 65535, 70000, -5]], dtype=np.int32)
    path = save(Image.fromarray(values), tmp_path / "i.tiff")
    rgb, _ = load_image(path)
    assert rgb[:, :, 1].tolist() == [[0, 255, 255, 0]]


def test_cmyk(tmp_path):
    img = Image.new("CMYK", (2, 1))
    img.putdata([(0, 0, 0, 0), (255, 0, 0, 0)])
    rgb, alpha = load_image(save(img, tmp_path / "c.tiff"))
    assert alpha is None
    assert rgb.tolist() == [[[255, 255, 255], [0, 255, 255]]]


def test_rgba(tmp_path):
    img = Image.new("RGBA", (2, 1))
    img.putdata([(10, 20, 30, 0), (40, 50, 60, 255)])
    path = save(img, tmp_path / "rgba.png")
    rgb, alpha = load_image(path, with_alpha=True)
    assert rgb.flags.writeable and rgb.flags.c_contiguous
    assert rgb.tolist() == [[[10, 20, 30], [40, 50, 60]]]  # colour under transparency is kept
    assert alpha.tolist() == [[0.0, 1.0]]
    assert load_image(path)[0].tolist() == [[[255, 255, 255], [40, 50, 60]]]
    assert load_image(path, background=None)[0].tolist() == [[[10, 20, 30], [40, 50, 60]]]  # sd-scripts' way


def test_exif_rotated_jpeg(tmp_path):
    # 32 wide, 16 tall: left half red, right half blue; orientation 6 shows it rotated 90 degrees clockwise.
    arr = np.zeros((16, 32, 3), np.uint8)
    arr[:, :16] = (255, 0, 0)
    arr[:, 16:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = save(Image.fromarray(arr), tmp_path / "rot.jpg", exif=exif.tobytes(), quality=95)
    rgb, _ = load_image(path)
    assert rgb.shape == (32, 16, 3)
    top, bottom = rgb[4, 8].astype(int), rgb[27, 8].astype(int)
    assert top[0] > 200 and top[2] < 60  # the left (red) half is now on top
    assert bottom[2] > 200 and bottom[0] < 60


@pytest.mark.parametrize("orientation", range(1, 9))
def test_apply_orientation_matches_pillow(orientation):
    arr = np.random.RandomState(0).randint(0, 255, (3, 5, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    img.getexif()[0x0112] = orientation
    assert np.array_equal(apply_orientation(arr, orientation), np.asarray(ImageOps.exif_transpose(img)))


def test_bad_files_raise_decode_error_naming_the_file(tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    text = tmp_path / "notes.jpg"
    text.write_text("not an image")
    good = tmp_path / "good.png"
    Image.fromarray(np.random.RandomState(1).randint(0, 255, (64, 64, 3), dtype=np.uint8)).save(good)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:300])
    jpg = tmp_path / "good.jpg"
    Image.fromarray(np.random.RandomState(1).randint(0, 255, (64, 64, 3), dtype=np.uint8)).save(jpg)
    truncated_jpg = tmp_path / "truncated.jpg"
    truncated_jpg.write_bytes(jpg.read_bytes()[:700])
    cases = {
        empty: "empty file (0 bytes)",
        text: "not a recognised image format",
        truncated: "cannot decode image",
        truncated_jpg: "cannot decode image",
        tmp_path / "missing.png": "file not found",
    }
    for path, reason in cases.items():
        with pytest.raises(ImageDecodeError) as info:
            load_image(str(path))
        message = str(info.value)
        assert message.startswith(f"{path}: ") and reason in message, message
        assert "\n" not in message
        assert isinstance(info.value, DataError)


def test_is_image_file():
    assert [is_image_file(p) for p in ("a.PNG", "b.jpeg", "c.WebP", "d.bmp", "e.gif", "f.txt")] == [
        True, True, True, True, False, False,
    ]


# ---- resize and crop -------------------------------------------------------------------------


def test_crop_ltrb_golden():
    assert crop_ltrb_for((640, 384), (1200, 800)) == (32, 0, 608, 384)
    assert crop_ltrb_for((832, 1216), (1000, 1500)) == (10, 0, 820, 1216)
    assert crop_ltrb_for((512, 512), (512, 512)) == (0, 0, 512, 512)
    assert crop_ltrb_for((384, 640), (400, 1000)) == (64, 0, 320, 640)  # image 0.4 fits 256 wide inside 0.6
    assert flip_crop_ltrb((10, 0, 820, 1216), 832) == (12, 0, 822, 1216)


def test_resize_and_crop_centre():
    image = np.random.RandomState(2).randint(0, 255, (800, 1200, 3), dtype=np.uint8)
    out, crop = resize_and_crop(image, (640, 384), (640, 427), False, random.Random(0))
    assert out.shape == (384, 640, 3) and out.dtype == np.uint8
    assert crop == (32, 0, 608, 384)
    expected = resize_image(image, (640, 427))[21:405]  # (427 - 384) // 2 = 21 rows off the top
    assert np.array_equal(out, expected)


def test_resize_and_crop_random_uses_the_given_rng_only():
    image = np.arange(427 * 640 * 3, dtype=np.uint32).reshape(427, 640, 3).astype(np.uint8)
    out, crop = resize_and_crop(image, (640, 384), (640, 427), True, random.Random(5))
    y = random.Random(5).randint(0, 43)  # no draw for the width, which fits exactly
    assert np.array_equal(out, image[y : y + 384])
    # SAI-style box: the 1.499 image fitted inside the bucket is 575.5 wide; the random offset is ignored
    assert crop == (32, 0, 607, 384)


def test_mask_gets_the_same_crop():
    image = np.zeros((100, 300, 3), np.uint8)
    mask = np.tile(np.arange(300, dtype=np.float32) / 299.0, (100, 1))
    out, out_mask, crop = resize_and_crop_with_mask(image, mask, (256, 64), (300, 100), True, random.Random(3))
    rng = random.Random(3)
    x, y = rng.randint(0, 44), rng.randint(0, 36)
    assert out.shape == (64, 256, 3) and out_mask.shape == (64, 256)
    assert np.array_equal(out_mask, mask[y : y + 64, x : x + 256])
    assert crop == (32, 0, 224, 64)  # the 3:1 image fitted inside the 4:1 bucket is 192 wide


def test_resize_mask_stays_in_unit_range():
    mask = np.zeros((8, 8), np.float32)
    mask[:, 4:] = 1.0
    out, out_mask, _ = resize_and_crop_with_mask(
        np.zeros((8, 8, 3), np.uint8), mask, (20, 20), (20, 20), False, random.Random(0), "lanczos"
    )
    assert out_mask.dtype == np.float32 and out_mask.min() >= 0.0 and out_mask.max() <= 1.0


def test_named_interpolation_and_bad_name():
    image = np.array([[[0, 0, 0], [255, 255, 255]]], np.uint8)
    assert resize_image(image, (4, 1), "nearest")[0, :, 0].tolist() == [0, 0, 255, 255]
    with pytest.raises(ConfigError, match="resize_interpolation: expected one of lanczos, nearest"):
        validate_interpolation("sinc", "dataset.toml: datasets[0]")
    validate_interpolation(None, "x")


def test_random_crop_to_fixed_size():
    image = np.arange(10 * 12, dtype=np.uint8).reshape(10, 12, 1).repeat(3, axis=2)
    out = random_crop_to(image, (8, 8), random.Random(4))
    rng = random.Random(4)
    y, x = rng.randint(0, 2), rng.randint(0, 4)
    assert np.array_equal(out, image[y : y + 8, x : x + 8])


# ---- augmentation ----------------------------------------------------------------------------


def test_flip_horizontal():
    image = np.array([[[1, 1, 1], [2, 2, 2], [3, 3, 3]]], np.uint8)
    assert flip_horizontal(image)[0, :, 0].tolist() == [3, 2, 1]


def _seed_for(branch: str) -> int:
    for seed in range(1000):
        rng = random.Random(seed)
        if rng.random() > 0.33:
            kind = "none"
        else:
            kind = "hue" if rng.random() > 0.5 else "gamma"
        if kind == branch:
            return seed
    raise AssertionError(branch)


def test_color_augment_branches():
    image = np.array([[[128, 128, 128], [255, 0, 0]]], np.uint8)
    seed = _seed_for("none")
    assert np.array_equal(color_augment(image, random.Random(seed)), image)

    seed = _seed_for("gamma")
    rng = random.Random(seed)
    rng.random(), rng.random()
    gamma = rng.uniform(0.95, 1.05)
    out = color_augment(image, random.Random(seed))
    assert out[0, 0].tolist() == [round(255 * (128 / 255) ** gamma)] * 3
    assert out[0, 1].tolist() == [255, 0, 0]

    seed = _seed_for("hue")
    out = color_augment(image, random.Random(seed))
    assert out[0, 0].tolist() == [128, 128, 128]  # grey has no hue
    assert out.shape == image.shape


def test_color_augment_is_deterministic_per_seed():
    image = np.random.RandomState(0).randint(0, 255, (8, 8, 3), dtype=np.uint8)
    outs = [color_augment(image, random.Random(s)) for s in range(20)]
    again = [color_augment(image, random.Random(s)) for s in range(20)]
    assert all(np.array_equal(a, b) for a, b in zip(outs, again))
    assert any(not np.array_equal(o, image) for o in outs)


def test_parse_face_box():
    assert parse_face_box("/d/img_100_80_40_50.png") == FaceBox(100, 80, 40, 50)
    assert parse_face_box("/d/img.png") is None
    assert parse_face_box("/d/a_b_c_d_e.png") is None
    assert parse_face_box("/d/x_0_0_0_0.png") is None


def test_face_crop_without_scaling():
    image = np.random.RandomState(0).randint(0, 255, (300, 400, 3), dtype=np.uint8)
    face = FaceBox(300, 150, 40, 40)
    out = face_crop(image, (2.0, 2.0), random.Random(0), face=face, target_size=(128, 128))
    assert np.array_equal(out, image[86:214, 236:364])


def test_face_crop_scales_the_face_down():
    image = np.random.RandomState(0).randint(0, 255, (300, 400, 3), dtype=np.uint8)
    face = FaceBox(200, 150, 200, 200)
    out = face_crop(image, (1.0, 1.0), random.Random(0), face=face, target_size=(128, 128))
    # scale 128 / 200 = 0.64 -> 256x192, face centre (128, 96)
    assert np.array_equal(out, resize_image(image, (256, 192), "area")[32:160, 64:192])


def test_face_crop_without_face_is_a_no_op():
    image = np.zeros((10, 10, 3), np.uint8)
    assert face_crop(image, (1.0, 2.0), random.Random(0)) is image


def test_to_tensor():
    t = to_tensor(np.array([[[0, 255, 127]]], np.uint8))
    assert t.shape == (3, 1, 1) and t.dtype == torch.float32
    assert t.flatten().tolist() == pytest.approx([-1.0, 1.0, 127 / 127.5 - 1.0])
