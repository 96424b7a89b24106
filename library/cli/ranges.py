"""Range checks of every numeric training flag, before anything is read or loaded.

Each flag declares the values that can work, as the "range" of its field (library/cli/options.py). A value
outside is a one-line ConfigError naming the flag, the value and the expected range (exit code 2). Every float
flag must also be finite (`nan`, `inf` and overflowing literals are refused). Checks that need the loaded model
(--clip_skip against the encoder's depth) are `ModelFamily.check_loaded`, called right after the model loads.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from library.cli.options import MAX_LEARNING_RATE, MAX_SEED, Range, flag_specs  # noqa: F401 (re-exported)
from library.cli.parser import CORE_FLAG_GROUPS, FAMILY_FLAG_RANGES
from library.core.errors import ConfigError

# Every flag's range: declared with the flag (library/cli/*.py), or listed in parser.py for a family's flags.
RANGES: dict[str, Range] = {**{spec.name: spec.range for cls in CORE_FLAG_GROUPS for spec in flag_specs(cls)
                               if spec.range is not None}, **FAMILY_FLAG_RANGES}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ranges(values: Mapping[str, Any]) -> None:
    """ConfigError for the first numeric flag out of its range or not finite (values: vars(namespace))."""
    for name, value in sorted(values.items()):  # .items(): a check, not a use (tests/test_flag_audit.py)
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if not _number(item):
                continue
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"--{name} {item}: expected a finite number")
            rule = RANGES.get(name)
            if rule is not None and not rule.contains(item):
                raise ConfigError(f"--{name} {item if isinstance(item, int) else format(item, 'g')}: "
                                  f"expected {rule.describe()}")


def check_resolution_steps(resolution: Optional[str], enable_bucket: bool, model_multiple: int) -> None:
    """Without --enable_bucket every --resolution side is trained as given, so it must be a multiple of what the
    model needs (its bucket step: 64 for SD 1.x/2.x, 32 for SDXL/FLUX.1); with buckets the sides only set the
    area (sd-scripts' rule), checked by the data layer."""
    if not resolution or enable_bucket:
        return
    for part in str(resolution).split(";"):
        for side in part.split(","):
            side = side.strip()
            if side.isdigit() and int(side) % model_multiple:
                raise ConfigError(f"--resolution {resolution}: expected sides that are multiples of {model_multiple} "
                                  f"for this model without --enable_bucket, got {side}")
