"""Latent cache files on disk (`--cache_latents_to_disk`): names, writing, and the validity check.

File name and keys are sd-scripts' (`<stem>_<WWWW>x<HHHH><arch>.npz` with
`latents`, `original_size`, `crop_ltrb`, optional `latents_flipped` and
`alpha_mask`), so the files are interchangeable. `alpha_mask` holds the sample's
loss mask whatever its source (alpha channel, conditioning_data_dir image or
`-masklabel.png`), cropped like the latents. We add one key,
`cache_settings`, holding a JSON signature of everything that produced the
latents; an entry is reused only when that signature and the latent shape
match what the run expects, so a changed bucket, crop, VAE or flag rebuilds it
instead of training on stale or wrongly sized latents.

Families whose sd-scripts caches suffix the keys with the latent size (Flux:
`latents_64x96`, `original_size_64x96`, ...) pass that suffix as `key_suffix`;
one file then holds an image at several resolutions, and writing one
resolution keeps the others.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import numpy as np

from library.core.io_utils import atomic_path

SETTINGS_KEY = "cache_settings"
_SIZE_IN_NAME = re.compile(r"_(\d{4,})x(\d{4,})(_[A-Za-z0-9]+)?\.npz$")


def disk_cache_path(image_path: str, original_size: tuple[int, int], arch_suffix: str) -> str:
    """`<dir>/<stem>_<WWWW>x<HHHH><arch_suffix>.npz` for an image of original (width, height)."""
    stem = os.path.splitext(image_path)[0]
    width, height = original_size
    return f"{stem}_{width:04d}x{height:04d}{arch_suffix}.npz"


def size_from_cache_path(cache_path: str) -> Optional[tuple[int, int]]:
    """The original (width, height) encoded in a cache file name, or None if the name has none."""
    match = _SIZE_IN_NAME.search(os.path.basename(cache_path))
    return (int(match.group(1)), int(match.group(2))) if match else None


def latent_key_suffix(bucket_reso: tuple[int, int], stride: Optional[int]) -> str:
    """`_<h>x<w>` (latent height x width) for a (width, height) bucket, or "" when stride is None."""
    if stride is None:
        return ""
    width, height = bucket_reso
    return f"_{height // stride}x{width // stride}"


@dataclass(frozen=True)
class CacheSettings:
    """Everything that decides the cached latents; any difference makes a cache entry stale.

    vae_id names the VAE and its dtype (e.g. a file hash or preset name plus "fp32").
    latent_shape is (C, h, w) of the latents the run expects.
    """

    bucket_reso: tuple[int, int]
    crop_ltrb: tuple[int, int, int, int]
    flip_aug: bool
    alpha_mask: bool
    vae_id: str
    latent_shape: tuple[int, int, int]
    random_crop: bool = False
    # Where the stored mask came from (library/data/mask_sources.mask_signature): "alpha", or a mask
    # file's kind, name, size and mtime. Left out of the signature when "", so caches written before
    # this field existed stay valid.
    mask_source: str = ""
    # How the posterior sample was drawn (library/objectives/posterior.POSTERIOR_DRAW: from each image's own
    # seed). Caches written before (drawn from the encoding process's generator, so they depended on the number
    # of processes) have no such key and are rebuilt. Left out of the signature when "".
    posterior: str = ""
    # Edit training: the control images' names, sizes and mtimes (library/data/control_images.control_signature);
    # their latents are stored as `control_latents_<i>` (and `control_latents_flipped_<i>`). "" without controls.
    control_source: str = ""

    def controls(self) -> int:
        return len(self.control_source.split("|")) if self.control_source else 0

    def signature(self) -> str:
        """Stable JSON text of these settings (sorted keys, tuples as lists, plain ints)."""
        data = asdict(self)
        for optional in ("mask_source", "posterior", "control_source"):
            if not data[optional]:
                del data[optional]
        for key in ("bucket_reso", "crop_ltrb", "latent_shape"):
            data[key] = [int(v) for v in data[key]]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))


@dataclass
class LatentCacheEntry:
    """The arrays of one valid cache file. alpha_mask is (H, W) at the bucket resolution, 0..1."""

    latents: np.ndarray
    original_size: tuple[int, int]
    crop_ltrb: tuple[int, int, int, int]
    latents_flipped: Optional[np.ndarray] = None
    alpha_mask: Optional[np.ndarray] = None
    control_latents: tuple = ()  # edit training: one (C, h, w) array per control image
    control_latents_flipped: tuple = ()


def _to_numpy(value: Any) -> np.ndarray:
    """float32 numpy from a numpy array or a torch tensor (on any device, any dtype)."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


def save_latent_cache(
    path: str,
    latents: Union[np.ndarray, Any],
    original_size: tuple[int, int],
    crop_ltrb: tuple[int, int, int, int],
    settings: CacheSettings,
    latents_flipped: Optional[Union[np.ndarray, Any]] = None,
    alpha_mask: Optional[Union[np.ndarray, Any]] = None,
    key_suffix: str = "",
    control_latents: tuple = (),
    control_latents_flipped: tuple = (),
) -> None:
    """Write one latent cache .npz atomically (temporary name, then rename).

    With a key_suffix, the arrays of other resolutions already in the file are kept.
    """
    arrays = {
        "latents": _to_numpy(latents),
        "original_size": np.array([int(v) for v in original_size]),
        "crop_ltrb": np.array([int(v) for v in crop_ltrb]),
        SETTINGS_KEY: np.array(settings.signature()),
    }
    if latents_flipped is not None:
        arrays["latents_flipped"] = _to_numpy(latents_flipped)
    if alpha_mask is not None:
        arrays["alpha_mask"] = _to_numpy(alpha_mask)
    for i, control in enumerate(control_latents):
        arrays[f"control_latents_{i}"] = _to_numpy(control)
    for i, control in enumerate(control_latents_flipped):
        arrays[f"control_latents_flipped_{i}"] = _to_numpy(control)
    arrays = {key + key_suffix: value for key, value in arrays.items()}
    if key_suffix:
        arrays = {**_other_resolutions(path, key_suffix), **arrays}
    with atomic_path(path) as tmp:
        # Writing to an open file stops numpy from appending ".npz" to the temporary name.
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)


def _other_resolutions(path: str, key_suffix: str) -> dict[str, np.ndarray]:
    """The arrays of an existing file whose keys do not end in key_suffix ({} if none or unreadable)."""
    if not os.path.exists(path):
        return {}
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files if not key.endswith(key_suffix)}
    except Exception:  # a damaged file is simply replaced
        return {}


def _shapes_fit(data: Any, expected: CacheSettings, sfx: str) -> bool:
    """True when the arrays the run needs are present, finite and of the expected shapes."""
    shape = tuple(expected.latent_shape)
    needed = ["latents"] + (["latents_flipped"] if expected.flip_aug else [])
    for i in range(expected.controls()):  # a control has the target's bucket, so its latents have the same shape
        needed += [f"control_latents_{i}"] + ([f"control_latents_flipped_{i}"] if expected.flip_aug else [])
    for key in (k + sfx for k in needed):
        if key not in data.files or tuple(data[key].shape) != shape or not np.isfinite(data[key]).all():
            return False
    if expected.alpha_mask:
        bucket_hw = (expected.bucket_reso[1], expected.bucket_reso[0])
        if "alpha_mask" + sfx not in data.files or tuple(data["alpha_mask" + sfx].shape) != bucket_hw:
            return False
    return "original_size" + sfx in data.files and "crop_ltrb" + sfx in data.files


def _stored_signature(data: Any, sfx: str) -> Optional[str]:
    if SETTINGS_KEY + sfx not in data.files:
        return None
    value = data[SETTINGS_KEY + sfx]
    return str(value.item()) if value.shape == () else None


def load_latent_cache(
    path: str, expected: CacheSettings, accept_foreign: bool = False, key_suffix: str = ""
) -> Optional[LatentCacheEntry]:
    """The cached arrays when the file is valid for `expected`, else None (never raises).

    Stale means: missing or unreadable file, a missing key, a latent shape other
    than expected.latent_shape, non-finite latents, no `latents_flipped` while
    flip_aug is on, no `alpha_mask` while alpha_mask is on, or a settings signature
    that differs. A file without our signature (written by sd-scripts) counts
    as stale unless `accept_foreign` is True and every shape matches; then its
    bucket, crop and VAE are trusted unchecked. Keys are read with `key_suffix`.
    """
    sfx = key_suffix
    try:
        with np.load(path, allow_pickle=False) as data:
            if not _shapes_fit(data, expected, sfx):
                return None
            signature = _stored_signature(data, sfx)
            if signature is None:
                if not accept_foreign:
                    return None
            elif signature != expected.signature():
                return None
            original = tuple(int(v) for v in data["original_size" + sfx])
            crop = tuple(int(v) for v in data["crop_ltrb" + sfx])
            if len(original) != 2 or len(crop) != 4:
                return None
            return LatentCacheEntry(
                latents=np.asarray(data["latents" + sfx], dtype=np.float32),
                original_size=original,
                crop_ltrb=crop,
                latents_flipped=(
                    np.asarray(data["latents_flipped" + sfx], dtype=np.float32) if expected.flip_aug else None
                ),
                alpha_mask=np.asarray(data["alpha_mask" + sfx], dtype=np.float32) if expected.alpha_mask else None,
                control_latents=tuple(np.asarray(data[f"control_latents_{i}{sfx}"], dtype=np.float32)
                                      for i in range(expected.controls())),
                control_latents_flipped=tuple(np.asarray(data[f"control_latents_flipped_{i}{sfx}"], dtype=np.float32)
                                              for i in range(expected.controls() if expected.flip_aug else 0)),
            )
    except Exception:  # any damage (truncated zip, bad header, wrong dtype) just means "rebuild it"
        return None
