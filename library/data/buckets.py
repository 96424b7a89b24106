"""Aspect-ratio buckets: the bucket list, assigning an image to a bucket, and the checks on bucket settings.

The rules match sd-scripts exactly (same bucket list, same choice of bucket,
same resized size), so a dataset lands in the same buckets as it did there.
All sizes are (width, height).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence, Union

from library.core.errors import ConfigError, DataError

Size = tuple[int, int]


def cover_size(reso: Size, image_width: int, image_height: int) -> Size:
    """The size an image is resized to so that it covers the bucket `reso` (then center-cropped to it)."""
    if image_width / image_height > reso[0] / reso[1]:  # wider than the bucket: match the height
        scale = reso[1] / image_height
    else:
        scale = reso[0] / image_width
    return (int(image_width * scale + 0.5), int(image_height * scale + 0.5))


class ImageTooSmallError(DataError):
    """With bucket_no_upscale, an image smaller than one bucket step on a side has no bucket."""


def make_bucket_resolutions(
    max_reso: Size, min_size: int = 256, max_size: int = 1024, divisible: int = 64
) -> list[Size]:
    """All bucket sizes of about the area of `max_reso`, sorted by (width, height).

    The square bucket comes first, then for each width from `min_size` to
    `max_size` in steps of `divisible`, the tallest height (a multiple of
    `divisible`, at most `max_size`) that keeps the area within the target; each
    such pair is added in both orientations when the height is at least `min_size`.
    """
    area = max_reso[0] * max_reso[1]
    side = int(math.sqrt(area) // divisible) * divisible
    resos: set[Size] = {(side, side)}
    for width in range(min_size, max_size + 1, divisible):
        height = min(max_size, (area // width) // divisible * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
    return sorted(resos)


def adjust_min_max_to_steps(min_size: int, max_size: int, reso_steps: int) -> tuple[int, int]:
    """Round min down and max up to multiples of `reso_steps` (what sd-scripts does, with a warning)."""
    if min_size % reso_steps:
        min_size -= min_size % reso_steps
    if max_size % reso_steps:
        max_size += reso_steps - max_size % reso_steps
    return min_size, max_size


def _as_size(resolution: Union[int, Sequence[int]]) -> Size:
    if isinstance(resolution, int):
        return (resolution, resolution)
    w, h = resolution
    return (int(w), int(h))


def validate_bucket_settings(
    resolution: Union[int, Sequence[int]],
    min_size: int,
    max_size: int,
    reso_steps: int,
    required_multiple: int,
    where: str,
) -> None:
    """Raise ConfigError (one line naming `where`) when the bucket settings cannot work.

    `required_multiple` is what the model family needs of `bucket_reso_steps`
    (64 for SD 1.x/2.x, 32 for SDXL/Flux). min/max are first rounded to steps
    the way sd-scripts does, then must satisfy min <= resolution <= max.
    """
    for name, value in (("bucket_reso_steps", reso_steps), ("min_bucket_reso", min_size), ("max_bucket_reso", max_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: {name}: expected an integer >= 1, got {value!r}")
    if reso_steps % required_multiple:
        raise ConfigError(
            f"{where}: bucket_reso_steps: expected a multiple of {required_multiple} for this model, got {reso_steps}"
        )
    width, height = _as_size(resolution)
    if width < 1 or height < 1:
        raise ConfigError(f"{where}: resolution: expected positive sizes, got {width}x{height}")
    lo, hi = adjust_min_max_to_steps(min_size, max_size, reso_steps)
    if lo > hi:
        raise ConfigError(f"{where}: min_bucket_reso {min_size} is larger than max_bucket_reso {max_size}")
    if min(width, height) < lo:
        raise ConfigError(
            f"{where}: min_bucket_reso: expected at most the smaller resolution side {min(width, height)}, "
            f"got {min_size} (rounded to steps of {reso_steps}: {lo})"
        )
    if max(width, height) > hi:
        raise ConfigError(
            f"{where}: max_bucket_reso: expected at least the larger resolution side {max(width, height)}, "
            f"got {max_size} (rounded to steps of {reso_steps}: {hi})"
        )


def check_fixed_resolution(
    image_size: Size, resolution: Size, random_crop_or_face_crop: bool
) -> Optional[str]:
    """Without buckets, describe why an image cannot be used at `resolution`, or None if it can.

    The image must equal the resolution, or be larger on a side only when it is
    randomly (or face-) cropped; nothing is resized. sd-scripts asserts here; we
    report so every bad image can be listed before training starts.
    """
    iw, ih = image_size
    rw, rh = resolution
    if iw == rw and ih == rh:
        return None
    if iw < rw or ih < rh:
        return (
            f"image is {iw}x{ih}, smaller than the resolution {rw}x{rh}; "
            "enlarge it or set enable_bucket = true"
        )
    if not random_crop_or_face_crop:
        return (
            f"image is {iw}x{ih}, larger than the resolution {rw}x{rh}; "
            "set enable_bucket = true or random_crop = true"
        )
    return None


@dataclass
class BucketAssignment:
    """Where one image goes: its bucket, the size it is resized to before cropping, and the aspect error."""

    bucket_reso: Size
    resized_size: Size
    ar_error: float


class BucketManager:
    """Picks a bucket for each image and collects image keys per bucket.

    Call `make_buckets()` (or `set_predefined_resos`) unless `no_upscale` is on,
    then `select_bucket` / `add_image` (or `assign`, which does both), then
    `sort()` before reading `resos` / `buckets` / `bucket_info()`.
    """

    def __init__(
        self,
        no_upscale: bool,
        max_reso: Optional[Size],
        min_size: Optional[int],
        max_size: Optional[int],
        reso_steps: int,
    ) -> None:
        self.no_upscale = no_upscale
        self.max_reso = tuple(max_reso) if max_reso is not None else None
        self.max_area = self.max_reso[0] * self.max_reso[1] if self.max_reso is not None else None
        self.min_size = min_size
        self.max_size = max_size
        self.reso_steps = reso_steps
        self.resos: list[Size] = []  # buckets actually used, in the order first used (sorted by sort())
        self.buckets: list[list[Hashable]] = []  # image keys per entry of resos
        self._reso_to_id: dict[Size, int] = {}
        self._ar_errors: list[float] = []
        self.predefined_resos: list[Size] = []
        self._predefined_set: set[Size] = set()
        self._predefined_ars: list[float] = []

    def make_buckets(self) -> None:
        """Build the predefined bucket list from max_reso, min_size, max_size and reso_steps."""
        if self.max_reso is None or self.min_size is None or self.max_size is None:
            raise ValueError("make_buckets needs max_reso, min_size and max_size")
        self.set_predefined_resos(
            make_bucket_resolutions(self.max_reso, self.min_size, self.max_size, self.reso_steps)
        )

    def set_predefined_resos(self, resos: Sequence[Size]) -> None:
        """Use exactly these buckets (e.g. a fine-tuning metadata file's list) instead of make_buckets()."""
        self.predefined_resos = [tuple(r) for r in resos]
        self._predefined_set = set(self.predefined_resos)
        self._predefined_ars = [w / h for w, h in self.predefined_resos]

    def _round_to_steps(self, x: float) -> int:
        rounded = int(x + 0.5)
        return rounded - rounded % self.reso_steps

    def select_bucket(self, image_width: int, image_height: int) -> tuple[Size, Size, float]:
        """Return (bucket_reso, resized_size, ar_error) for an image; the bucket is registered as used.

        The image is resized to `resized_size` (which covers the bucket) and then
        cropped to `bucket_reso`. `ar_error` is bucket aspect minus image aspect.
        """
        aspect = image_width / image_height
        if not self.no_upscale:
            reso, resized = self._select_predefined(image_width, image_height, aspect)
        else:
            reso, resized = self._select_no_upscale(image_width, image_height, aspect)
        self._register(reso)
        return reso, resized, reso[0] / reso[1] - aspect

    def _select_predefined(self, image_width: int, image_height: int, aspect: float) -> tuple[Size, Size]:
        if not self.predefined_resos:
            raise ValueError("no buckets: call make_buckets() or set_predefined_resos() first")
        reso = (image_width, image_height)
        if reso not in self._predefined_set:
            # The first bucket with the smallest |aspect error| wins, as numpy argmin does in sd-scripts.
            errors = [abs(ar - aspect) for ar in self._predefined_ars]
            reso = self.predefined_resos[errors.index(min(errors))]
        return reso, cover_size(reso, image_width, image_height)

    def select_given(self, reso: Size, image_width: int, image_height: int) -> tuple[Size, Size, float]:
        """Like select_bucket, for a bucket already chosen (a fine-tune metadata file's train_resolution):
        the image is resized to cover it and cropped."""
        reso = (int(reso[0]), int(reso[1]))
        self._register(reso)
        return reso, cover_size(reso, image_width, image_height), reso[0] / reso[1] - image_width / image_height

    def given_bucket_problem(self, reso: Size, image_width: int, image_height: int) -> Optional[str]:
        """Why `reso` cannot be this image's bucket under these settings, or None: sides must be multiples of
        reso_steps within [min_size, max_size] (rounded to steps), the area at most max_reso's, and with
        no_upscale not larger than the image."""
        w, h = reso
        if w % self.reso_steps or h % self.reso_steps:
            return f"expected multiples of bucket_reso_steps {self.reso_steps}"
        if self.min_size is not None and self.max_size is not None:
            low, high = adjust_min_max_to_steps(self.min_size, self.max_size, self.reso_steps)
            if not (low <= w <= high and low <= h <= high):
                return f"expected sides between min_bucket_reso {low} and max_bucket_reso {high}"
        if self.max_area is not None and w * h > self.max_area:
            return (f"expected an area of at most {self.max_reso[0]}x{self.max_reso[1]} "
                    f"(the resolution); prepare_buckets_latents was run with a larger --max_resolution")
        if self.no_upscale and (w > image_width or h > image_height):
            return f"larger than the {image_width}x{image_height} image, and bucket_no_upscale is set"
        return None

    def _select_no_upscale(self, image_width: int, image_height: int, aspect: float) -> tuple[Size, Size]:
        if self.max_area is None:
            raise ValueError("bucket_no_upscale needs max_reso")
        if image_width * image_height > self.max_area:
            resized = self._shrink_to_area(aspect)
        else:
            resized = (image_width, image_height)
        # The bucket is never larger than the resized image, so it is cropped, never padded.
        reso = (resized[0] - resized[0] % self.reso_steps, resized[1] - resized[1] % self.reso_steps)
        if reso[0] < 1 or reso[1] < 1:
            raise ImageTooSmallError(
                f"image {image_width}x{image_height} is smaller than bucket_reso_steps {self.reso_steps} "
                "on a side, so it has no bucket with bucket_no_upscale"
            )
        return reso, resized

    def _shrink_to_area(self, aspect: float) -> Size:
        """Shrink to the target area at the same aspect; round the side that loses less aspect to steps."""
        width = math.sqrt(self.max_area * aspect)
        height = self.max_area / width
        w_rounded = self._round_to_steps(width)
        h_in_w = self._round_to_steps(w_rounded / aspect)
        h_rounded = self._round_to_steps(height)
        w_in_h = self._round_to_steps(h_rounded * aspect)
        # An extreme aspect can round a side to 0; treat that candidate as infinitely wrong.
        err_w = abs(w_rounded / h_in_w - aspect) if h_in_w else math.inf
        err_h = abs(w_in_h / h_rounded - aspect) if h_rounded else math.inf
        if err_w < err_h:
            return (w_rounded, int(w_rounded / aspect + 0.5))
        return (int(h_rounded * aspect + 0.5), h_rounded)

    def _register(self, reso: Size) -> int:
        if reso not in self._reso_to_id:
            self._reso_to_id[reso] = len(self.resos)
            self.resos.append(reso)
            self.buckets.append([])
        return self._reso_to_id[reso]

    def add_image(self, reso: Size, key: Hashable) -> None:
        """Put one image key (once per repeat) into the bucket `reso`."""
        self.buckets[self._register(tuple(reso))].append(key)

    def assign(self, key: Hashable, image_width: int, image_height: int, repeats: int = 1) -> BucketAssignment:
        """Select a bucket, add `key` `repeats` times, and record the aspect error once (as sd-scripts)."""
        reso, resized, ar_error = self.select_bucket(image_width, image_height)
        for _ in range(repeats):
            self.add_image(reso, key)
        self._ar_errors.append(abs(ar_error))
        return BucketAssignment(reso, resized, ar_error)

    def record_ar_error(self, ar_error: float) -> None:
        """Record one image's aspect error for mean_img_ar_error (when not using assign())."""
        self._ar_errors.append(abs(ar_error))

    def sort(self) -> None:
        """Order used buckets by (width, height), keeping each bucket's keys."""
        order = sorted(range(len(self.resos)), key=lambda i: self.resos[i])
        self.resos = [self.resos[i] for i in order]
        self.buckets = [self.buckets[i] for i in order]
        self._reso_to_id = {reso: i for i, reso in enumerate(self.resos)}

    def bucket_info(self) -> dict[str, Any]:
        """`{"buckets": {i: {"resolution": [w, h], "count": n}}, "mean_img_ar_error": x}` for non-empty buckets.

        This is what sd-scripts writes (as JSON) into the ss_bucket_info metadata;
        call sort() first so the indices match.
        """
        info: dict[str, Any] = {"buckets": {}}
        for i, (reso, keys) in enumerate(zip(self.resos, self.buckets)):
            if keys:
                info["buckets"][i] = {"resolution": [reso[0], reso[1]], "count": len(keys)}
        errors = self._ar_errors
        info["mean_img_ar_error"] = float(sum(errors) / len(errors)) if errors else 0.0
        return info
