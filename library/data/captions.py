"""The caption pipeline: what a raw caption becomes for one sample at one step.

Order (as sd-scripts): prefix/suffix, caption dropout, wildcard / first line,
fixed vs flexible tags, token warmup, shuffle, tag dropout, join, secondary
separators. Every random choice comes from the `rng` passed in, so a sample's
caption depends only on its seed, never on worker scheduling.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Optional

# `{a|b}` not preceded by `{` nor followed by `}`; `{{` and `}}` are literal braces.
_WILDCARD = re.compile(r"(?<!\{)\{([^{}]+)\}(?!\})")


@dataclass(frozen=True)
class CaptionSettings:
    """Per-subset caption options (the dataset TOML keys of the same names)."""

    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    secondary_separator: Optional[str] = None
    enable_wildcard: bool = False
    caption_prefix: Optional[str] = None
    caption_suffix: Optional[str] = None
    token_warmup_min: int = 1
    token_warmup_step: float = 0  # steps, or a fraction (< 1) of max_train_steps
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0

    def without_randomness(self) -> "CaptionSettings":
        """The same settings with shuffle, dropout and warmup off (validation captions stay stable)."""
        from dataclasses import replace

        return replace(self, shuffle_caption=False, caption_dropout_rate=0.0, caption_dropout_every_n_epochs=0,
                       caption_tag_dropout_rate=0.0, token_warmup_step=0)


def warmup_steps(token_warmup_step: float, max_train_steps: int) -> int:
    """Token warmup length in steps: a value < 1 is a fraction of max_train_steps."""
    if token_warmup_step < 1:
        return math.floor(token_warmup_step * max_train_steps)
    return int(token_warmup_step)


def _split_tags(text: str, separator: str) -> list[str]:
    return [t.strip() for t in text.split(separator) if t.strip()]


def resolve_wildcards(caption: str, rng: random.Random) -> str:
    """Pick one line of a multi-line caption, replace each `{a|b|c}` by one choice, unescape `{{ }}`."""
    if "\n" in caption:
        caption = rng.choice(caption.split("\n"))
    caption = _WILDCARD.sub(lambda m: rng.choice(m.group(1).split("|")), caption)
    return caption.replace("{{", "{").replace("}}", "}")


def _fixed_and_flexible(caption: str, s: CaptionSettings) -> tuple[list[str], list[str], list[str]]:
    """(fixed prefix tags, flexible tags, fixed suffix tags)."""
    sep = s.caption_separator
    if s.keep_tokens_separator and s.keep_tokens_separator in caption:
        fixed_part, flex_part = caption.split(s.keep_tokens_separator, 1)
        suffix: list[str] = []
        if s.keep_tokens_separator in flex_part:
            flex_part, suffix_part = flex_part.split(s.keep_tokens_separator, 1)
            suffix = _split_tags(suffix_part, sep)
        return _split_tags(fixed_part, sep), _split_tags(flex_part, sep), suffix
    tags = [t.strip() for t in caption.strip().split(sep)]
    if s.keep_tokens > 0:
        return tags[: s.keep_tokens], tags[s.keep_tokens:], []
    return [], tags, []


def process_caption(caption: str, s: CaptionSettings, rng: random.Random, epoch: int, step: int,
                    max_train_steps: int, replacements: tuple[tuple[str, str], ...] = ()) -> str:
    """Apply the caption pipeline to one raw caption.

    `epoch` is 1-based (caption_dropout_every_n_epochs drops on epochs N, 2N, ...); `step` is the
    global step the sample is trained at (token warmup). `replacements` are (from, to) pairs applied
    last (textual-inversion token strings).
    """
    if s.caption_prefix:
        caption = s.caption_prefix + " " + caption
    if s.caption_suffix:
        caption = caption + " " + s.caption_suffix

    dropped = s.caption_dropout_rate > 0 and rng.random() < s.caption_dropout_rate
    if s.caption_dropout_every_n_epochs > 0 and epoch % s.caption_dropout_every_n_epochs == 0:
        dropped = True
    if dropped:
        return ""

    if s.enable_wildcard:
        caption = resolve_wildcards(caption, rng)
    else:
        caption = caption.split("\n")[0]

    warmup = warmup_steps(s.token_warmup_step, max_train_steps)
    # Only rebuild the tag list when something changes it, so a plain caption keeps its exact spacing.
    if s.shuffle_caption or warmup > 0 or s.caption_tag_dropout_rate > 0:
        fixed, flexible, suffix = _fixed_and_flexible(caption, s)
        if warmup and step < warmup:
            keep = math.floor(step * (len(flexible) - s.token_warmup_min) / warmup) + s.token_warmup_min
            flexible = flexible[:keep]
        if s.shuffle_caption:
            rng.shuffle(flexible)
        if s.caption_tag_dropout_rate > 0:
            flexible = [t for t in flexible if rng.random() >= s.caption_tag_dropout_rate]
        caption = ", ".join(fixed + flexible + suffix)

    if s.secondary_separator:
        caption = caption.replace(s.secondary_separator, s.caption_separator)
    for old, new in replacements:
        caption = caption.replace(old, new)
    return caption


def tag_frequency(captions: list[str], separator: str = ",") -> dict[str, int]:
    """Lower-cased tag counts over raw captions, in first-seen order (for ss_tag_frequency)."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in _split_tags(caption, separator):
            counts[tag.lower()] = counts.get(tag.lower(), 0) + 1
    return counts
