"""--blocks_to_swap for DiTs with one list of blocks (SD3, Anima, Lumina): sd-scripts swaps the last N blocks and
allows at most blocks - 2. FLUX.1 / Chroma split N between two block kinds (flux/loading.py swap_split)."""

from __future__ import annotations

import re
from typing import Optional

from library.core.errors import ConfigError


def check_last_blocks_swap(num_swap: int, blocks: int, kind: str = "blocks") -> None:
    """sd-scripts' bound, as one ConfigError line (`kind`: what the family calls its blocks)."""
    if not 1 <= num_swap <= blocks - 2:
        raise ConfigError(f"--blocks_to_swap {num_swap}: expected 1..{blocks - 2} for this model ({blocks} {kind}; "
                          f"at most blocks - 2 swap, as sd-scripts)")


def last_blocks(blocks: list, num_swap: int, kind: str = "blocks") -> list:
    """The blocks --blocks_to_swap N keeps in CPU memory: the last N, in forward order (bound checked)."""
    check_last_blocks_swap(num_swap, len(blocks), kind)
    return blocks[len(blocks) - num_swap:]


def indexed_blocks_in_file(path: str, pattern: str) -> Optional[int]:
    """How many distinct block indices (`pattern`'s group 1) a safetensors file's keys hold, read without loading
    weights; None when it holds none."""
    from safetensors import safe_open

    matcher = re.compile(pattern)
    with safe_open(path, "pt") as f:
        indices = {m[1] for k in f.keys() if (m := matcher.match(k))}
    return len(indices) or None
