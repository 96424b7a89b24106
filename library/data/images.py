"""Image loading, resizing/cropping into a bucket, and per-sample augmentation.

Images are numpy arrays: (H, W, 3) uint8 RGB; masks are (H, W) float32 in 0..1.
Every random choice takes an explicit `random.Random`, which the caller seeds
from (seed, epoch, index) so a resumed run draws the same numbers.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image

from library.core.errors import ConfigError, DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")

# resize_interpolation names (sd-scripts' list). "area" maps to PIL's BOX filter,
# which averages each output pixel over its source area, as cv2.INTER_AREA does when
# shrinking; this keeps OpenCV out of the dependencies.
INTERPOLATIONS = {
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "linear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "cubic": Image.Resampling.BICUBIC,
    "area": Image.Resampling.BOX,
    "box": Image.Resampling.BOX,
}

WHITE = (255, 255, 255)
_EXIF_ORIENTATION_TAG = 0x0112


class ImageDecodeError(DataError):
    """An image file is missing, empty, truncated, corrupt or in an unsupported format."""


def is_image_file(path: str) -> bool:
    """True when the file name has one of IMAGE_EXTENSIONS (any letter case)."""
    return os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation (1..8, 1 = upright) of an opened image, read without decoding pixels.

    For PNG only an eXIf chunk seen while reading the header counts: Pillow would
    otherwise decode the whole file to look for one after the pixel data. The
    header scanner and load_image both use this, so they always agree on the size.
    """
    try:
        if img.format == "PNG":
            exif = Image.Exif()
            raw = img.info.get("exif")
            if raw:
                exif.load(raw)
        else:
            exif = img.getexif()
        value = int(exif.get(_EXIF_ORIENTATION_TAG, 1))
    except Exception:  # a broken EXIF block must not make a good image unusable
        return 1
    return value if 1 <= value <= 8 else 1


def oriented_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    """The displayed (width, height): orientations 5..8 rotate by 90 degrees and swap the sides."""
    return (height, width) if orientation >= 5 else (width, height)


def apply_orientation(array: np.ndarray, orientation: int) -> np.ndarray:
    """Rotate/mirror an (H, W, ...) array so it shows upright (same result as PIL's exif_transpose)."""
    if orientation == 2:
        out = array[:, ::-1]
    elif orientation == 3:
        out = array[::-1, ::-1]
    elif orientation == 4:
        out = array[::-1]
    elif orientation == 5:
        out = array.swapaxes(0, 1)
    elif orientation == 6:
        out = np.rot90(array, k=-1)
    elif orientation == 7:
        out = array[::-1, ::-1].swapaxes(0, 1)
    elif orientation == 8:
        out = np.rot90(array, k=1)
    else:
        return array
    return np.ascontiguousarray(out)


def _high_bit_depth_to_8bit(img: Image.Image) -> np.ndarray:
    """Scale a 16-bit ("I;16*", "I") or float ("F") grey image to (H, W) uint8 by value, not by clipping."""
    values = np.asarray(img)
    if img.mode == "F":
        # Float images have no fixed range; 0..255 is the convention of Pillow's own "F" -> "L".
        return np.clip(np.rint(values), 0, 255).astype(np.uint8)
    # 16-bit: 0..65535 maps onto 0..255 (divide by 257), rounded to nearest.
    values = np.clip(values.astype(np.int64), 0, 65535)
    return ((values * 255 + 32767) // 65535).astype(np.uint8)


def _has_alpha(img: Image.Image) -> bool:
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info


def _decode_pixels(img: Image.Image) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(H, W, 3) uint8 RGB and (H, W) uint8 alpha or None, from a loaded image of any mode."""
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        grey = _high_bit_depth_to_8bit(img)
        return np.repeat(grey[:, :, None], 3, axis=2), None
    if _has_alpha(img):
        rgba = np.array(img.convert("RGBA"), dtype=np.uint8)
        return np.ascontiguousarray(rgba[:, :, :3]), np.ascontiguousarray(rgba[:, :, 3])
    return np.array(img.convert("RGB"), dtype=np.uint8), None


def load_image(
    path: str, with_alpha: bool = False, background: Optional[tuple[int, int, int]] = WHITE
) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Decode an image file to ((H, W, 3) uint8 RGB, alpha) with EXIF orientation applied.

    Any mode is accepted: palette (with transparency), L, LA, 1-bit, CMYK,
    16-bit grey (scaled to 8 bits), RGB, RGBA.
    - with_alpha=True: the RGB channels are returned as stored and `alpha` is
      (H, W) float32 in 0..1 (all ones for an image without transparency).
    - with_alpha=False: `alpha` is None and transparent pixels are composited
      onto `background` (white by default), because the colour hidden under
      transparency is arbitrary (often black). background=None drops the alpha
      channel as sd-scripts does.
    Raises ImageDecodeError (naming the file) for a missing, empty, truncated or corrupt file.
    """
    try:
        if os.path.getsize(path) == 0:
            raise ImageDecodeError(f"{path}: empty file (0 bytes), not an image")
        with Image.open(path) as img:
            orientation = exif_orientation(img)
            img.load()  # force a full decode so truncated files fail here, not mid-training
            rgb, alpha8 = _decode_pixels(img)
    except ImageDecodeError:
        raise
    except FileNotFoundError:
        raise ImageDecodeError(f"{path}: file not found") from None
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(f"{path}: too many pixels to load safely ({exc})") from None
    except Image.UnidentifiedImageError:
        raise ImageDecodeError(f"{path}: not a recognised image format (unreadable header)") from None
    except Exception as exc:  # decoders raise OSError, SyntaxError, ValueError, zlib errors...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageDecodeError(f"{path}: cannot decode image: {reason}") from None

    rgb = apply_orientation(rgb, orientation)
    if alpha8 is not None:
        alpha8 = apply_orientation(alpha8, orientation)
    if with_alpha:
        if alpha8 is None:
            return rgb, np.ones(rgb.shape[:2], dtype=np.float32)
        return rgb, alpha8.astype(np.float32) / 255.0
    if alpha8 is not None and background is not None:
        a = alpha8.astype(np.float32)[:, :, None] / 255.0
        bg = np.asarray(background, dtype=np.float32)
        rgb = np.rint(rgb.astype(np.float32) * a + bg * (1.0 - a)).astype(np.uint8)
    return rgb, None


def validate_interpolation(name: Optional[str], where: str) -> None:
    """Raise ConfigError when `name` is not a resize_interpolation this toolkit knows (None is fine)."""
    if name is not None and name not in INTERPOLATIONS:
        raise ConfigError(f"{where}: resize_interpolation: expected one of {', '.join(INTERPOLATIONS)}, got {name!r}")


def _resample_filter(src_size: tuple[int, int], dst_size: tuple[int, int], interpolation: Optional[str]):
    if interpolation is None:
        # Default: area average when shrinking on both sides, lanczos when enlarging.
        shrinking = src_size[0] >= dst_size[0] and src_size[1] >= dst_size[1]
        interpolation = "area" if shrinking else "lanczos"
    validate_interpolation(interpolation, "resize_and_crop")
    return INTERPOLATIONS[interpolation]


def resize_image(image: np.ndarray, size: tuple[int, int], interpolation: Optional[str] = None) -> np.ndarray:
    """Resize an (H, W, 3) uint8 image to size=(width, height) with a named or default filter."""
    h, w = image.shape[:2]
    if (w, h) == tuple(size):
        return image
    resample = _resample_filter((w, h), size, interpolation)
    return np.array(Image.fromarray(image).resize(tuple(size), resample=resample))


def resize_mask(mask: np.ndarray, size: tuple[int, int], interpolation: Optional[str] = None) -> np.ndarray:
    """Resize an (H, W) float mask to size=(width, height), clipped to 0..1 (lanczos overshoots)."""
    h, w = mask.shape[:2]
    if (w, h) == tuple(size):
        return mask.astype(np.float32, copy=False)
    resample = _resample_filter((w, h), size, interpolation)
    out = np.asarray(Image.fromarray(mask.astype(np.float32)).resize(tuple(size), resample=resample))
    return np.clip(out, 0.0, 1.0).astype(np.float32)  # clip allocates a new, writable array


def crop_ltrb_for(bucket_reso: tuple[int, int], image_size: tuple[int, int]) -> tuple[int, int, int, int]:
    """SAI-style crop box (left, top, right, bottom) used for SDXL size conditioning.

    As in sd-scripts, it is the image fitted *inside* the bucket and centred, not
    the crop actually taken (also for random crop); left/top equal sd-scripts',
    right/bottom are truncated to integers.
    """
    bw, bh = bucket_reso
    image_ar = image_size[0] / image_size[1]
    if bw / bh > image_ar:
        fit_w, fit_h = bh * image_ar, float(bh)
    else:
        fit_w, fit_h = float(bw), bw / image_ar
    left = int((bw - fit_w) // 2)
    top = int((bh - fit_h) // 2)
    return left, top, int(left + fit_w), int(top + fit_h)


def flip_crop_ltrb(crop_ltrb: tuple[int, int, int, int], width: int) -> tuple[int, int, int, int]:
    """The crop box of a horizontally flipped image of the given width (left = width - right)."""
    left, top, right, bottom = crop_ltrb
    return width - right, top, width - left, bottom


def _crop_offsets(size: tuple[int, int], bucket_reso: tuple[int, int], random_crop: bool, rng: random.Random):
    """(x, y) of the bucket inside the resized image: centred, or drawn (x first, then y)."""
    offsets = []
    for length, target in zip(size, bucket_reso):
        excess = length - target
        if excess < 0:
            raise ValueError(f"resized size {size} does not cover bucket {bucket_reso}")
        offsets.append(rng.randint(0, excess) if random_crop and excess > 0 else excess // 2)
    return offsets[0], offsets[1]


def resize_and_crop_with_mask(
    image: np.ndarray,
    mask: Optional[np.ndarray],
    bucket_reso: tuple[int, int],
    resized_size: tuple[int, int],
    random_crop: bool,
    rng: random.Random,
    interpolation: Optional[str] = None,
) -> tuple[np.ndarray, Optional[np.ndarray], tuple[int, int, int, int]]:
    """Resize image (and mask) to `resized_size`, then crop both at the same place to `bucket_reso`.

    Returns (image, mask or None, crop_ltrb); crop_ltrb comes from crop_ltrb_for()
    with the image's size before resizing.
    """
    image, mask, _, crop_ltrb = resize_and_crop_all(image, mask, None, bucket_reso, resized_size, random_crop, rng,
                                                    interpolation)
    return image, mask, crop_ltrb


def resize_and_crop_all(
    image: np.ndarray,
    mask: Optional[np.ndarray],
    conditioning: Optional[np.ndarray],
    bucket_reso: tuple[int, int],
    resized_size: tuple[int, int],
    random_crop: bool,
    rng: random.Random,
    interpolation: Optional[str] = None,
) -> tuple[np.ndarray, Optional[np.ndarray], Optional[np.ndarray], tuple[int, int, int, int]]:
    """resize_and_crop_with_mask, and a conditioning image (H, W, 3 uint8, the image's size) resized and cropped
    exactly as the image: (image, mask, conditioning, crop_ltrb). The same random numbers are drawn either way."""
    h, w = image.shape[:2]
    image = resize_image(image, resized_size, interpolation)
    if mask is not None:
        mask = resize_mask(mask, resized_size, interpolation)
    if conditioning is not None:
        conditioning = resize_image(conditioning, resized_size, interpolation)
    x, y = _crop_offsets(resized_size, bucket_reso, random_crop, rng)
    bw, bh = bucket_reso
    image = np.ascontiguousarray(image[y : y + bh, x : x + bw])
    if mask is not None:
        mask = np.ascontiguousarray(mask[y : y + bh, x : x + bw])
    if conditioning is not None:
        conditioning = np.ascontiguousarray(conditioning[y : y + bh, x : x + bw])
    return image, mask, conditioning, crop_ltrb_for(bucket_reso, (w, h))


def resize_and_crop(
    image: np.ndarray,
    bucket_reso: tuple[int, int],
    resized_size: tuple[int, int],
    random_crop: bool,
    rng: random.Random,
    interpolation: Optional[str] = None,
) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Resize to `resized_size` (which covers the bucket) and crop to `bucket_reso`; returns (image, crop_ltrb)."""
    out, _, crop_ltrb = resize_and_crop_with_mask(image, None, bucket_reso, resized_size, random_crop, rng, interpolation)
    return out, crop_ltrb


def random_crop_to(image: np.ndarray, target_size: tuple[int, int], rng: random.Random) -> np.ndarray:
    """Non-bucket mode: cut a random (width, height) window from a larger image (height first, as sd-scripts)."""
    tw, th = target_size
    h, w = image.shape[:2]
    if h > th:
        y = rng.randint(0, h - th)
        image = image[y : y + th]
    if w > tw:
        x = rng.randint(0, w - tw)
        image = image[:, x : x + tw]
    return np.ascontiguousarray(image)


def flip_horizontal(image: np.ndarray) -> np.ndarray:
    """Mirror an (H, W, ...) image left to right."""
    return np.ascontiguousarray(image[:, ::-1])


def color_augment(image: np.ndarray, rng: random.Random) -> np.ndarray:
    """sd-scripts' color_aug: one time in three, either a hue shift of up to +-16 degrees or a gamma of 0.95..1.05.

    sd-scripts raises raw 0..255 values to the gamma (which saturates at 1.05);
    here the gamma applies to 0..1 values, the usual meaning.
    """
    if rng.random() > 0.33:
        return image
    if rng.random() > 0.5:
        # PIL's hue channel spans 0..255 for 360 degrees; cv2's (used by sd-scripts) spans 0..179.
        shift = int(round(rng.uniform(-8.0, 8.0) * 256.0 / 180.0))
        hsv = np.array(Image.fromarray(image).convert("HSV"))
        hsv[:, :, 0] = ((hsv[:, :, 0].astype(np.int16) + shift) % 256).astype(np.uint8)
        return np.array(Image.fromarray(hsv, mode="HSV").convert("RGB"))
    gamma = rng.uniform(0.95, 1.05)
    table = np.rint(255.0 * (np.arange(256) / 255.0) ** gamma).astype(np.uint8)
    return table[image]


@dataclass(frozen=True)
class FaceBox:
    """A face centre and size in image pixels, from a file name ending in `_cx_cy_w_h`."""

    cx: int
    cy: int
    width: int
    height: int


def parse_face_box(path: str) -> Optional[FaceBox]:
    """Read `name_cx_cy_w_h.ext` face info; None when the stem does not end in four integers or cx is 0."""
    tokens = os.path.splitext(os.path.basename(path))[0].split("_")
    if len(tokens) < 5:
        return None
    try:
        cx, cy, fw, fh = (int(t) for t in tokens[-4:])
    except ValueError:
        return None
    if cx <= 0 or fw <= 0 or fh <= 0:
        return None
    return FaceBox(cx, cy, fw, fh)


def face_crop(
    image: np.ndarray,
    face_crop_aug_range: tuple[float, float],
    rng: random.Random,
    face: Optional[FaceBox] = None,
    target_size: Optional[tuple[int, int]] = None,
    random_crop: bool = False,
) -> np.ndarray:
    """Non-bucket mode face crop (sd-scripts' rule): scale so the face is 1/hi..1/lo of the short side, cut around it.

    The scale never enlarges and never makes the image smaller than `target_size`
    (width, height). With random_crop the window drifts up to the far edge with a
    triangular distribution; without it, a small jitter of +-face/20 when the
    range is not a single value. Without `face`, the image is returned unchanged.
    """
    if face is None or target_size is None:
        return image
    tw, th = target_size
    h, w = image.shape[:2]
    if (w, h) == (tw, th):
        return image
    face_size = max(face.width, face.height)
    short_side = min(tw, th)
    lo, hi = face_crop_aug_range
    cover = max(th / h, tw / w)
    min_scale = min(1.0, max(cover, short_side / (face_size * hi)))
    max_scale = min(1.0, max(min_scale, short_side / (face_size * lo)))
    scale = min_scale if min_scale >= max_scale else rng.uniform(min_scale, max_scale)
    nw, nh = max(tw, int(w * scale + 0.5)), max(th, int(h * scale + 0.5))
    image = resize_image(image, (nw, nh), "area")
    centre = (int(face.cy * scale + 0.5), int(face.cx * scale + 0.5))
    for axis, (target, length, face_pos) in enumerate(zip((th, tw), (nh, nw), centre)):
        start = face_pos - target // 2
        if random_crop:
            reach = max(length - face_pos, face_pos)
            start += rng.randint(0, reach) + rng.randint(0, reach) - reach
        elif lo != hi and face_size > short_side // 10 and face_size >= 40:
            start += rng.randint(-face_size // 20, face_size // 20)
        start = max(0, min(start, length - target))
        image = image[start : start + target] if axis == 0 else image[:, start : start + target]
    return np.ascontiguousarray(image)


def to_unit_tensor(image: np.ndarray):
    """(H, W, 3) uint8 -> torch.FloatTensor (3, H, W) in [0, 1] (a conditioning image, as sd-scripts' ToTensor)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div_(255.0)


def to_tensor(image: np.ndarray):
    """(H, W, 3) uint8 -> torch.FloatTensor (3, H, W) in [-1, 1]."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div_(127.5).sub_(1.0)
