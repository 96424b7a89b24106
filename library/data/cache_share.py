"""One process's part of building a cache when several processes train (latents, text-encoder outputs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class CacheShare:
    """Filled by the loop from torch.distributed; the data layer only calls it."""
    rank: int
    world: int
    planned: Callable[[], None]  # a barrier: every process has planned (read the disk) before any writes
    gather: Optional[Callable[[Any], list]] = None  # all processes' objects, by rank
