"""Split a subset's images into training and validation sets, reproducibly (same result as sd-scripts)."""

from __future__ import annotations

import math
import random
from typing import Sequence, TypeVar

T = TypeVar("T")


def split_for_validation(items: Sequence[T], split: float, seed: int) -> tuple[list[T], list[T]]:
    """Shuffle `items` with random.Random(seed); train = the first ceil(n*(1-split)), validation = the last round(n*split).

    With split 0 everything is training data. For n=7, split=0.2, seed=1234 the
    validation set is the 7th item, as in sd-scripts.
    """
    shuffled = list(items)
    if split <= 0 or not shuffled:
        return shuffled, []
    random.Random(seed).shuffle(shuffled)
    n = len(shuffled)
    n_train = math.ceil(n * (1 - split))
    n_val = round(n * split)
    validation = shuffled[n - n_val:] if n_val > 0 else []
    return shuffled[:n_train], validation
