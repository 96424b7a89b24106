"""One SIGINT/SIGTERM handler for a whole run, installed when the process starts.

Before the loop runs (loading, scanning, caching) a signal stops at once: `StopRequested`
(a KeyboardInterrupt, so no `except Exception` swallows it) unwinds, atomic writers remove
their partial files, and the entry script prints one line. Inside the loop the first signal
asks for a stop after the current step (the state is saved); a second one stops at once.
The handler replaces an inherited SIG_IGN, so `kill -INT` reaches a job started with `&`.
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    """A signal arrived outside the loop (or twice): stop now; nothing half-written stays behind."""

    def __init__(self, signum: int, when: str = "before training started"):
        super().__init__(f"stopped by signal {signum} {when}; nothing more was saved")
        self.signum = signum


class StopHandler:
    def __init__(self):
        self.signum: Optional[int] = None
        self.in_loop = False
        self._previous: dict[int, object] = {}

    def install(self) -> "StopHandler":
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _on_signal(self, signum, frame) -> None:
        if not self.in_loop or self.signum is not None:
            when = "before training started" if not self.in_loop else "a second time, during a step"
            self.signum = self.signum or signum
            raise StopRequested(signum, when)
        self.signum = signum
        logger.warning("signal %d: saving state after the current step, then stopping", signum)


def nan_hint(mixed_precision: str, full_fp16: bool = False, full_bf16: bool = False, no_half_vae: bool = False,
             max_grad_norm: float = 1.0) -> str:
    """What to try after a NaN / inf, from the run's own settings: only changes the run has not made yet."""
    tips = []
    if mixed_precision == "fp16":
        tips.append("--mixed_precision bf16 (or no, for float32)")
    elif mixed_precision == "bf16":
        tips.append("--mixed_precision no (float32)")
    if full_fp16 or full_bf16:
        tips.append(f"training without --{'full_fp16' if full_fp16 else 'full_bf16'}")
    if mixed_precision != "no" and not no_half_vae:
        tips.append("--no_half_vae")
    if not max_grad_norm:
        tips.append("--max_grad_norm 1 (gradient clipping is off)")
    tips.append("a lower learning rate")
    return "try " + (", ".join(tips[:-1]) + " or " if len(tips) > 1 else "") + tips[-1]
