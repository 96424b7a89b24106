"""Every dataset TOML key: where it may appear, its type check, its default and its CLI flag.

A check converts a TOML value or raises Expected("an integer >= 1"), which the
config layer turns into `file: path.key: expected ..., got ...`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from library.data.options import RESIZE_INTERPOLATIONS


class Expected(Exception):
    """Raised by a check; the message says what was expected."""


# Levels: a "dataset" key may be in [general] or [[datasets]]; a "subset" key anywhere
# (it ascends: general > dataset > subset); a "subset_only" key only in [[datasets.subsets]].
DATASET, SUBSET, SUBSET_ONLY = "dataset", "subset", "subset_only"


@dataclass(frozen=True)
class Key:
    name: str
    check: Callable[[Any], Any]
    default: Any
    level: str
    flag: Optional[str] = None  # DataOptions attribute that is the CLI fallback
    cli_check: Optional[Callable[[Any], Any]] = None  # parses the flag's string form

    def check_cli(self, value: Any) -> Any:
        return (self.cli_check or self.check)(value)

    def where_allowed(self) -> str:
        return {DATASET: "allowed in [general] and [[datasets]]",
                SUBSET: "allowed in [general], [[datasets]] and [[datasets.subsets]]",
                SUBSET_ONLY: "allowed only in [[datasets.subsets]]"}[self.level]


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Expected("true or false")
    return v


def _int(minimum: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise Expected(f"an integer >= {minimum}")
        return v
    return check


def _opt_int(v: Any) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise Expected("an integer")
    return v


def _number(lo: float, hi: float, hi_open: bool = False) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        bad = isinstance(v, bool) or not isinstance(v, (int, float))
        if bad or v < lo or v > hi or (hi_open and v >= hi):
            raise Expected(f"a number from {lo:g} to {hi:g}" + (" (exclusive)" if hi_open else ""))
        return float(v)
    return check


def _nonneg_number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise Expected("a number >= 0")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise Expected("a string")
    return v


def _nonempty_str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise Expected("a non-empty string")
    return v


def _table(v: Any) -> dict:
    if not isinstance(v, dict):
        raise Expected("a table")
    return v


def _choice(*options: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in options:
            raise Expected("one of " + ", ".join(f'"{o}"' for o in options))
        return v
    return check


def _positive_size(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise Expected("resolution as a positive integer, [width, height] or a list of those")
    return v


def _resolutions(v: Any) -> list[tuple[int, int]]:
    """512 -> [(512,512)]; [512, 768] -> [(512,768)] (width, height, as sd-scripts); any other list is
    several resolutions, each an integer or [width, height] (e.g. [[512,512],[768,768]] or [512, 768, 1024])."""
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return [(_positive_size(v[0]), _positive_size(v[1]))]
    if isinstance(v, list) and v:
        out = []
        for item in v:
            if isinstance(item, list) and len(item) == 2:
                out.append((_positive_size(item[0]), _positive_size(item[1])))
            else:
                size = _positive_size(item)
                out.append((size, size))
        return out
    size = _positive_size(v)
    return [(size, size)]


def _resolutions_cli(v: Any) -> list[tuple[int, int]]:
    """'512', '512,768' (width,height) or several separated by ';': '512;768', '512,512;768,1024'."""
    text = str(v).strip()
    out = []
    try:
        for part in [p for p in text.split(";") if p.strip()]:
            nums = [int(x) for x in part.split(",")]
            if len(nums) == 1 and nums[0] > 0:
                out.append((nums[0], nums[0]))
            elif len(nums) == 2 and min(nums) > 0:
                out.append((nums[0], nums[1]))
            else:
                raise ValueError
    except ValueError:
        raise Expected('"SIZE" or "WIDTH,HEIGHT", several separated by ";"') from None
    if not out:
        raise Expected('"SIZE" or "WIDTH,HEIGHT"')
    return out


def _batch_size(v: Any) -> Any:
    if isinstance(v, list):
        if not v:
            raise Expected("an integer >= 1 or a list of those (one per resolution)")
        return [_int(1)(x) for x in v]
    try:
        return _int(1)(v)
    except Expected:
        raise Expected("an integer >= 1 or a list of those (one per resolution)") from None


def _float_pair(v: Any) -> Optional[tuple[float, float]]:
    if v is None:
        return None
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v) or v[0] > v[1]):
        raise Expected("[low, high] numbers with low <= high")
    return float(v[0]), float(v[1])


def _float_pair_cli(v: Any) -> Optional[tuple[float, float]]:
    try:
        parts = [float(x) for x in str(v).split(",")]
    except ValueError:
        raise Expected('"LOW,HIGH"') from None
    return _float_pair(parts)


def _fractions(v: Any) -> list[float]:
    if (not isinstance(v, list) or not v
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 for x in v)):
        raise Expected("a list of numbers > 0")
    return [float(x) for x in v]


def _fractions_cli(v: Any) -> list[float]:
    try:
        return _fractions([float(x) for x in str(v).split(",")])
    except ValueError:
        raise Expected('comma-separated numbers like "0.3,0.7"') from None


def _aspect_limit(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v == 0 or v >= 1):
        raise Expected("a number >= 1 (the longer side over the shorter), or 0 for no limit")
    return float(v)


def _opt(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


_KEYS = [
    # dataset level
    Key("resolution", _resolutions, None, DATASET, "resolution", _resolutions_cli),
    Key("batch_size", _batch_size, 1, DATASET, "train_batch_size"),
    Key("enable_bucket", _bool, False, DATASET, "enable_bucket"),
    Key("min_bucket_reso", _int(1), 256, DATASET, "min_bucket_reso"),
    Key("max_bucket_reso", _int(1), 1024, DATASET, "max_bucket_reso"),
    Key("bucket_reso_steps", _int(1), 64, DATASET, "bucket_reso_steps"),
    Key("bucket_no_upscale", _bool, False, DATASET, "bucket_no_upscale"),
    Key("network_multiplier", _number(-1e9, 1e9), 1.0, DATASET),  # accepted for compatibility; unused, as in sd-scripts
    Key("resolution_schedule", _choice("all", "progressive"), "all", DATASET, "resolution_schedule"),
    Key("resolution_step_fractions", _fractions, None, DATASET, "resolution_step_fractions", _fractions_cli),
    # extensions: images outside these limits are skipped and named before training (docs/dataset_config.md)
    Key("min_image_side", _int(0), 64, DATASET, "min_image_side"),
    Key("max_aspect_ratio", _aspect_limit, 8.0, DATASET, "max_aspect_ratio"),
    # subset level (may ascend to dataset / general)
    Key("num_repeats", _int(1), 1, SUBSET),
    Key("shuffle_caption", _bool, False, SUBSET, "shuffle_caption"),
    Key("caption_separator", _nonempty_str, ",", SUBSET, "caption_separator"),
    Key("keep_tokens", _int(0), 0, SUBSET, "keep_tokens"),
    Key("keep_tokens_separator", _str, "", SUBSET, "keep_tokens_separator"),
    Key("secondary_separator", _opt(_str), None, SUBSET, "secondary_separator"),
    Key("enable_wildcard", _bool, False, SUBSET, "enable_wildcard"),
    Key("caption_prefix", _opt(_str), None, SUBSET, "caption_prefix"),
    Key("caption_suffix", _opt(_str), None, SUBSET, "caption_suffix"),
    Key("color_aug", _bool, False, SUBSET, "color_aug"),
    Key("flip_aug", _bool, False, SUBSET, "flip_aug"),
    Key("random_crop", _bool, False, SUBSET, "random_crop"),
    Key("face_crop_aug_range", _float_pair, None, SUBSET, "face_crop_aug_range", _float_pair_cli),
    Key("token_warmup_min", _int(1), 1, SUBSET, "token_warmup_min"),
    Key("token_warmup_step", _nonneg_number, 0, SUBSET, "token_warmup_step"),
    Key("caption_dropout_rate", _number(0, 1), 0.0, SUBSET, "caption_dropout_rate"),
    Key("caption_dropout_every_n_epochs", _int(0), 0, SUBSET, "caption_dropout_every_n_epochs"),
    Key("caption_tag_dropout_rate", _number(0, 1), 0.0, SUBSET, "caption_tag_dropout_rate"),
    Key("custom_attributes", _table, None, SUBSET),
    Key("validation_split", _number(0, 1, hi_open=True), 0.0, SUBSET, "validation_split"),
    Key("validation_seed", _opt_int, None, SUBSET, "validation_seed"),
    Key("resize_interpolation", _opt(_choice(*RESIZE_INTERPOLATIONS)), None, SUBSET, "resize_interpolation"),
    Key("class_tokens", _opt(_str), None, SUBSET),
    Key("caption_extension", _nonempty_str, ".caption", SUBSET, "caption_extension"),
    Key("cache_info", _bool, False, SUBSET),
    Key("alpha_mask", _bool, False, SUBSET, "alpha_mask"),
    Key("masked_loss", _bool, False, SUBSET, "masked_loss"),
    Key("unmasked_probability", _number(0, 1), 0.0, SUBSET, "unmasked_probability"),
    Key("unmasked_weight", _number(0, 1), 0.0, SUBSET, "unmasked_weight"),
    Key("normalize_masked_area_loss", _bool, False, SUBSET, "normalize_masked_area_loss"),
    Key("image_column", _nonempty_str, "image", SUBSET),
    Key("caption_column", _nonempty_str, "text", SUBSET),
    Key("dataset_split", _nonempty_str, "train", SUBSET),
    # subset only
    Key("image_dir", _nonempty_str, None, SUBSET_ONLY),
    Key("metadata_file", _nonempty_str, None, SUBSET_ONLY),
    Key("dataset_name", _nonempty_str, None, SUBSET_ONLY),
    Key("is_reg", _bool, False, SUBSET_ONLY),
    Key("conditioning_data_dir", _nonempty_str, None, SUBSET_ONLY, "conditioning_data_dir"),
    # musubi-tuner's key: each image's control (reference) image(s) for edit training (library/data/control_images.py)
    Key("control_directory", _nonempty_str, None, SUBSET_ONLY),
]

ALL_KEYS: dict[str, Key] = {k.name: k for k in _KEYS}
GENERAL_KEYS = {k.name: k for k in _KEYS if k.level in (DATASET, SUBSET)}
DATASET_KEYS = GENERAL_KEYS
SUBSET_KEYS = {k.name: k for k in _KEYS if k.level in (SUBSET, SUBSET_ONLY)}
