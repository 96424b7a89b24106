"""Prompt weighting for CLIP text encoders: "(word:1.2)", "(word)" x1.1, "[word]" /1.1, and long prompts.

The syntax is the one A1111's web UI and sd-scripts' long-prompt-weighting
pipeline read: brackets nest and multiply, an unclosed bracket weights the rest
of the prompt, and a backslash makes a bracket literal. Prompts longer than 75
tokens are encoded in 75-token windows (up to 225 tokens), laid out exactly as
the SD family does in training, so an unweighted prompt gives the same states
as `family.encode_text`. Weights scale each token's hidden state; the mean of
the states is then restored so weighting changes emphasis, not overall size.
"""

from __future__ import annotations

import logging
import math
import re

import torch

logger = logging.getLogger(__name__)

ROUND_MULTIPLIER = 1.1
SQUARE_MULTIPLIER = 1 / 1.1
MAX_CHUNKS = 3  # 225 tokens, as sd-scripts samples
_WEIGHT = re.compile(r":\s*([+-]?(?:\d+\.?\d*|\.\d+))\s*\)")


def parse_prompt_attention(text: str) -> list[tuple[str, float]]:
    """Split a prompt into (text, weight) runs.

    >>> parse_prompt_attention("a (red:1.5) [ball]")
    [('a ', 1.0), ('red', 1.5), (' ', 1.0), ('ball', 0.9090909090909091)]
    """
    runs: list[list] = []  # [text, weight]; weights are multiplied in place when a bracket closes
    round_open: list[int] = []
    square_open: list[int] = []
    extend = False  # may the next literal character join the last run?

    def literal(chars: str) -> None:
        nonlocal extend
        if extend and runs:
            runs[-1][0] += chars
        else:
            runs.append([chars, 1.0])
        extend = True

    def multiply(start: int, factor: float) -> None:
        nonlocal extend
        for run in runs[start:]:
            run[1] *= factor
        extend = False

    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            literal(text[i + 1])
            i += 2
            continue
        match = _WEIGHT.match(text, i) if c == ":" and round_open else None
        if match:
            multiply(round_open.pop(), float(match.group(1)))
            i = match.end()
            continue
        if c == "(":
            round_open.append(len(runs))
            extend = False
        elif c == "[":
            square_open.append(len(runs))
            extend = False
        elif c == ")" and round_open:
            multiply(round_open.pop(), ROUND_MULTIPLIER)
        elif c == "]" and square_open:
            multiply(square_open.pop(), SQUARE_MULTIPLIER)
        else:
            literal(c)
        i += 1
    for start in round_open:  # unclosed brackets weight everything after them
        multiply(start, ROUND_MULTIPLIER)
    for start in square_open:
        multiply(start, SQUARE_MULTIPLIER)
    merged: list[tuple[str, float]] = []
    for chars, weight in runs:
        if merged and merged[-1][1] == weight:
            merged[-1] = (merged[-1][0] + chars, weight)
        elif chars:
            merged.append((chars, weight))
    return merged or [("", 1.0)]


def tokens_with_weights(tokenizer, text: str) -> tuple[list[int], list[float]]:
    """Token ids (without BOS/EOS) of a weighted prompt and one weight per token."""
    ids: list[int] = []
    weights: list[float] = []
    for chars, weight in parse_prompt_attention(text):
        piece = tokenizer(chars, add_special_tokens=False, verbose=False).input_ids
        ids += piece
        weights += [weight] * len(piece)
    return ids, weights


def chunk_count(lengths: list[int], inner: int = 75, max_chunks: int = MAX_CHUNKS) -> int:
    """How many 75-token windows hold the longest prompt (at least 1, at most max_chunks)."""
    return max(1, min(max_chunks, max((math.ceil(n / inner) for n in lengths), default=1)))


def weighted_windows(tokenizer, texts: list[str], n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (B, n_chunks * 77) in the SD training layout and weights (B, n_chunks * 75 + 2).

    The weights line up with the states `encode_token_chunks` returns: the BOS of
    the first window, the 75 inner states of each window, the EOS of the last.
    """
    window = tokenizer.model_max_length
    inner = window - 2
    length = n_chunks * inner + 2
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    flat_ids, flat_weights = [], []
    for text in texts:
        ids, weights = tokens_with_weights(tokenizer, text)
        if len(ids) > length - 2:
            logger.warning("prompt longer than %d tokens; the rest is cut off: %r", length - 2, text[:80])
        ids, weights = ids[: length - 2], weights[: length - 2]
        fill = length - 2 - len(ids)
        flat_ids.append([bos] + ids + [eos] + [pad] * fill)
        flat_weights.append([1.0] + weights + [1.0] + [1.0] * fill)
    ids = torch.tensor(flat_ids, dtype=torch.long)
    weights = torch.tensor(flat_weights, dtype=torch.float32)
    if n_chunks == 1:
        return ids, weights
    windows = []
    for start in range(1, length - 1, inner):
        chunk = torch.cat([ids[:, :1], ids[:, start:start + inner], ids[:, -1:]], dim=1)
        if pad != eos:
            # A tokenizer with its own pad token (SD2): a window cut mid-text still ends in EOS,
            # and a window of padding only starts BOS EOS, as the training layout has it.
            mid_text = (chunk[:, -2] != eos) & (chunk[:, -2] != pad)
            chunk[mid_text, -1] = eos
            chunk[chunk[:, 1] == pad, 1] = eos
        windows.append(chunk)
    return torch.cat(windows, dim=1), weights


def apply_token_weights(states: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scale each token's state by its weight, then restore each prompt's mean (B, T, D)."""
    if bool((weights == 1.0).all()):
        return states
    weights = weights.to(states.device)
    before = states.float().mean(dim=(-2, -1))
    scaled = states.float() * weights.unsqueeze(-1)
    after = scaled.mean(dim=(-2, -1))
    # States with (near) zero mean have no mean to restore: dividing would give inf/NaN.
    size = states.float().abs().mean(dim=(-2, -1))
    ratio = torch.where(after.abs() > 1e-6 * size, before / after, torch.ones_like(after))
    return (scaled * ratio.view(-1, 1, 1)).to(states.dtype)
