"""Range checks of every numeric training flag, before anything is read or loaded.

Each flag declares the values that can work, as the "range" of its field (library/cli/options.py). A value
outside is a one-line ConfigError naming the flag, the value and the expected range (exit code 2). Every float flag must also be finite (`nan`, `inf` and overflowing
literals are refused). Checks that need the loaded model (--clip_skip against the encoder's depth) are
`ModelFamily.check_loaded`, called right after the model loads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from library.cli.options import flag_specs
from library.core.errors import ConfigError

MAX_LEARNING_RATE = 10.0  # no optimizer here trains above it; DAdaptation / Prodigy use 1.0
MAX_SEED = 2**32 - 1  # NumPy's seed range


@dataclass(frozen=True)
class Range:
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False  # lo itself is outside
    hi_open: bool = False
    integer: bool = False
    note: str = ""

    def contains(self, value: float) -> bool:
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return not (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        g = lambda v: f"{v:g}" if not self.integer else str(int(v))  # noqa: E731
        if self.lo is not None and self.hi is not None:
            left, right = ("(" if self.lo_open else "["), (")" if self.hi_open else "]")
            text = f"{kind} in {left}{g(self.lo)}, {g(self.hi)}{right}"
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {g(self.lo)}"
        elif self.hi is not None:
            text = f"{kind} {'<' if self.hi_open else '<='} {g(self.hi)}"
        else:
            text = f"a finite {'integer' if self.integer else 'number'}"
        return f"{text} ({self.note})" if self.note else text


def at_least(n: int, note: str = "") -> Range:
    """An integer >= n."""
    return Range(lo=n, integer=True, note=note)


LEARNING_RATE = Range(0, MAX_LEARNING_RATE, note=f"learning rates above {MAX_LEARNING_RATE:g} do not train; "
                                                 "DAdaptation/Prodigy use 1.0")
RATE = Range(0, 1)
SEED = Range(0, MAX_SEED, integer=True)

# The flags declared outside library/cli (a family's options, the flow-matching scheme): their ranges by name.
# Every other flag declares its range where it is declared (the "range" of its field; library/cli/options.py).
OTHER_RANGES: dict[str, Range] = {
    # FLUX.1 and flow matching
    "guidance_scale": Range(lo=0), "t5xxl_max_token_length": at_least(1), "sigmoid_scale": Range(lo=0, lo_open=True),
    "discrete_flow_shift": Range(lo=0, lo_open=True), "logit_mean": Range(), "logit_std": Range(lo=0, lo_open=True),
    "mode_scale": Range(),
}


@functools.lru_cache(maxsize=None)
def declared_ranges() -> dict[str, Range]:
    """flag -> Range of every flag of the training scripts (built on first use: the flag groups import this module)."""
    from library.cli.parser import CORE_FLAG_GROUPS

    out = {spec.name: spec.range for cls in CORE_FLAG_GROUPS for spec in flag_specs(cls) if spec.range is not None}
    return {**out, **OTHER_RANGES}


def __getattr__(name: str) -> Any:  # RANGES: the table of every flag's range (declared_ranges)
    if name == "RANGES":
        return declared_ranges()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
            rule = declared_ranges().get(name)
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
