"""Text-encoder output cache (`--cache_text_encoder_outputs[_to_disk]`): plan, encode once, store, look up.

Files are sd-scripts': `<stem><suffix>` beside each image (SDXL: `_te_outputs.npz`
with `hidden_state1`, `hidden_state2`, `pool2`, float32, no batch axis). As for
latents, we add `cache_settings`, a JSON signature of the model, token length and
the exact caption; a file is reused only when that signature and every array's
shape match, otherwise it is rebuilt. The cache is keyed by the final caption
text (with the family's text_key: Qwen-Image-Edit's holds the control images too),
which is fixed per sample because caching is refused when captions are
random (shuffle, dropout, token warmup, wildcards) or the text encoder trains.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import torch
from tqdm import tqdm

from library.core.errors import ConfigError
from library.core.hashes import weights_sha256
from library.core.io_utils import atomic_path
from library.data.cache_share import CacheShare
from library.data.captions import CaptionSettings, process_caption

logger = logging.getLogger(__name__)

SETTINGS_KEY = "cache_settings"
Encode = Callable[[list[str]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class TextCacheSettings:
    """What decides one cached entry: the encoders, the token length, the caption and the array shapes."""

    model_id: str
    max_token_length: Optional[int]
    caption: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (key, shape without the batch axis), sorted by key

    def signature(self) -> str:
        return json.dumps({"model_id": self.model_id, "max_token_length": self.max_token_length,
                           "caption": self.caption, "shapes": [[k, list(s)] for k, s in self.shapes]},
                          sort_keys=True, separators=(",", ":"))

    def served_by(self, signature: str) -> bool:
        """Whether a file stored with `signature` holds these outputs: the same encoders, length and caption,
        and at least these arrays (a file of every encoder serves a run that caches only the frozen ones)."""
        try:
            stored = json.loads(signature)
            if [stored["model_id"], stored["max_token_length"], stored["caption"]] != \
                    [self.model_id, self.max_token_length, self.caption]:
                return False
            have = {(k, tuple(s)) for k, s in stored["shapes"]}
        except (ValueError, KeyError, TypeError):
            return False
        return all((k, tuple(s)) in have for k, s in self.shapes)


def te_cache_path(image_path: str, suffix: str) -> str:
    """`<dir>/<stem><suffix>`, e.g. `img_te_outputs.npz` for `img.png`."""
    return os.path.splitext(image_path)[0] + suffix


def check_text_cache_allowed(captions: Iterable[tuple[str, CaptionSettings]], train_text_encoder: bool,
                             splittable: bool = False) -> None:
    """ConfigError when cached outputs would be stale: random captions or a text encoder that trains.

    `captions` holds (where, settings) per subset, `where` naming it for the message. With
    `splittable` (the family can cache frozen encoders while others train) training is allowed here.
    """
    if train_text_encoder and not splittable:
        raise ConfigError("--cache_text_encoder_outputs: the text encoders would train but their outputs are cached; "
                          "add --network_train_unet_only (or drop the cache flag)")
    for where, s in captions:
        random_part = caption_randomness(s)
        if random_part:
            raise ConfigError(f"--cache_text_encoder_outputs: {where} sets {random_part}, which changes captions "
                              "between steps; cached outputs would be stale. Turn one of them off")


def caption_randomness(s: CaptionSettings) -> Optional[str]:
    """The first caption setting that changes a caption between steps (shuffle, dropout, warmup, wildcards), or None."""
    return next((name for name, on in (
        ("shuffle_caption", s.shuffle_caption), ("caption_dropout_rate", s.caption_dropout_rate > 0),
        ("caption_dropout_every_n_epochs", s.caption_dropout_every_n_epochs > 0),
        ("caption_tag_dropout_rate", s.caption_tag_dropout_rate > 0),
        ("token_warmup_step", s.token_warmup_step > 0), ("enable_wildcard", s.enable_wildcard)) if on), None)


def save_text_cache(path: str, arrays: Mapping[str, torch.Tensor], settings: TextCacheSettings) -> None:
    """Write one `.npz` atomically: float32 arrays plus our settings signature."""
    data = {k: v.detach().float().cpu().numpy() for k, v in arrays.items()}
    data[SETTINGS_KEY] = np.array(settings.signature())
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # an open file keeps numpy from appending ".npz" to the temporary name
            np.savez(f, **data)


def load_text_cache(path: str, expected: TextCacheSettings) -> Optional[dict[str, torch.Tensor]]:
    """The expected arrays of a valid file (signature serves `expected`, shapes match, all finite), else None;
    never raises."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = data[SETTINGS_KEY] if SETTINGS_KEY in data.files else None
            if stored is None or stored.shape != () or not expected.served_by(str(stored.item())):
                return None
            out = {}
            for key, shape in expected.shapes:
                if key not in data.files or tuple(data[key].shape) != tuple(shape):
                    return None
                array = np.asarray(data[key], dtype=np.float32)
                if not np.isfinite(array).all():
                    return None
                out[key] = torch.from_numpy(array)
            return out
    except Exception:  # a damaged file just means "rebuild it"
        return None


def subset_caption_settings(data) -> list[tuple[str, CaptionSettings]]:
    """(name for messages, caption settings) of every subset of a TrainingData."""
    return [(f"subset {i}" + (f" ({sub.image_dir})" if getattr(sub, "image_dir", None) else ""), sub.captions)
            for i, sub in enumerate(data.subsets)]


def final_captions(samples: Iterable, subsets: list, max_train_steps: int) -> list[tuple[str, str]]:
    """(image path, caption as training sees it) for every sample; captions are deterministic here."""
    out = []
    for sample in samples:
        settings = subsets[sample.subset].captions.without_randomness()
        out.append((sample.path, process_caption(sample.caption, settings, random.Random(0), 1, 0, max_train_steps)))
    return out


def cache_source_id(model_path: str, dtype, settings: Mapping[str, Any], weights: Any = None) -> str:
    """What produced a cache entry: the model, its dtype, and the settings that change the outputs (e.g. fp8
    weights, Flux's --t5xxl file, T5 length and attention mask), so changing any of them rebuilds the cache.

    `weights` (the loaded model, or its state dict): the model is then named by a content hash of its
    weights instead of `model_path`, so different weights at the same path (a replaced VAE file) rebuild
    the cache, and the same weights at another path reuse it.
    """
    source = f"sha256:{weights_sha256(weights)}" if weights is not None else model_path
    extra = "".join(f"|{name}={value}" for name, value in settings.items())
    return f"{source}|{dtype}{extra}"


def build_text_cache(items: list[tuple[str, str]], encode: Encode, *, model_id: str,
                     max_token_length: Optional[int], suffix: Optional[str], to_disk: bool,
                     batch_size: int = 1, share: Optional[CacheShare] = None) -> dict[str, dict[str, torch.Tensor]]:
    """{caption: {key: tensor without batch axis}} for every (image path, caption) in `items`.

    Valid disk files are read instead of encoding; missing or stale ones are
    encoded in batches of `batch_size` and, with `to_disk`, written.
    With `share` (several processes) each process encodes every `world`-th caption left to encode and writes
    its files; the outputs are then exchanged (`share.gather`) so every process holds them all.
    """
    probe = encode([""])  # the shapes every entry must have
    shapes = tuple(sorted((k, tuple(v.shape[1:])) for k, v in probe.items()))
    cache: dict[str, dict[str, torch.Tensor]] = {}
    pending: dict[str, list[str]] = {}  # caption -> image paths whose files need writing
    for path, caption in items:
        if caption in cache and not to_disk:
            continue
        settings = TextCacheSettings(model_id, max_token_length, caption, shapes)
        if to_disk and suffix:
            entry = load_text_cache(te_cache_path(path, suffix), settings)
            if entry is not None:
                cache.setdefault(caption, entry)
                continue
            pending.setdefault(caption, []).append(path)
        elif caption not in cache:
            pending.setdefault(caption, [])
    todo = [c for c in pending if c not in cache]
    if share is not None:
        share.planned()  # every process has read the disk before any writes
        todo = todo[share.rank::share.world]
    for start in tqdm(range(0, len(todo), batch_size), desc="caching text encoder outputs", disable=not todo):
        chunk = todo[start:start + batch_size]
        with torch.no_grad():
            outputs = encode(chunk)
        for i, caption in enumerate(chunk):
            cache[caption] = {k: v[i].detach().cpu() for k, v in outputs.items()}
    mine = set(todo)
    if share is not None:
        for part in share.gather({c: cache[c] for c in todo}):
            for caption, entry in part.items():
                cache.setdefault(caption, entry)
    for caption, paths in pending.items():
        if share is not None and caption not in mine:
            continue  # another process encoded it and writes its files
        settings = TextCacheSettings(model_id, max_token_length, caption, shapes)
        for path in paths:
            save_text_cache(te_cache_path(path, suffix), cache[caption], settings)
    written = sum(len(p) for c, p in pending.items() if share is None or c in mine)
    logger.info("text encoder cache: %d captions, %d encoded, %d files written", len(cache), len(todo), written)
    return cache


def cached_conditioning(cache: Mapping[str, Mapping[str, torch.Tensor]], captions: list[str],
                        device: torch.device) -> dict[str, torch.Tensor]:
    """Stack the cached outputs of a batch's captions into the tensors encode_text would return."""
    entries = [cache[c] for c in captions]
    return {k: torch.stack([e[k] for e in entries]).to(device) for k in entries[0]}
