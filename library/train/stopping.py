"""One SIGINT/SIGTERM handler for a whole run, taking over from the entry script's first line.

Every entry script first calls `library.core.stop_signals.install_at_start()`, which records a signal that
arrives while torch and the library are imported; `StopHandler.install()` takes that request over and stops
at once. Before the loop runs (loading, scanning, caching) a signal stops at once: `StopRequested` (a
KeyboardInterrupt, so no `except Exception` swallows it) unwinds, atomic writers remove their partial files,
and the entry script prints one line. Inside the loop the first signal asks for a stop after the current step
(the state is saved); a second one stops at once. The handler replaces an inherited SIG_IGN, so `kill -INT`
reaches a job started with `&` (library/core/stop_signals.py says why).

A run started by a launcher (torchrun, accelerate launch) stops the same way when the launcher is gone: the
kernel's parent-death signal, and a getppid() check at every step (`requested`).
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

from library.core import stop_signals
from library.core.stop_signals import PARENT_DEATH_SIGNAL

logger = logging.getLogger(__name__)

SIGNALS = stop_signals.STOP_SIGNALS


class StopRequested(KeyboardInterrupt):
    """A signal arrived outside the loop (or twice): stop now; nothing half-written stays behind."""

    def __init__(self, signum: int, when: str = "before training started", why: Optional[str] = None):
        super().__init__(stop_signals.stopped_line(why or stop_signals.signal_why(signum), when))
        self.signum = signum


class StopHandler:
    def __init__(self):
        self.signum: Optional[int] = None  # what the exit status reports (128 + signum)
        self.why: Optional[str] = None  # "by signal 2", "because its launcher (pid 41) is gone"
        self.in_loop = False
        self.launcher: Optional[int] = None  # the launcher's pid when one started this process
        self._previous: dict[int, object] = {}

    def install(self) -> "StopHandler":
        """Handle the stop signals from now on; a request recorded since the entry script started stops here
        (StopRequested), as does a launcher that is already gone."""
        pending, inherited = stop_signals.take_over()
        self.launcher = stop_signals.watch_launcher()
        watched = SIGNALS + ((PARENT_DEATH_SIGNAL,) if self.launcher is not None and PARENT_DEATH_SIGNAL else ())
        for sig in watched:
            current = signal.getsignal(sig)
            self._previous[sig] = inherited.get(sig, current) if stop_signals.is_start_handler(current) else current
            signal.signal(sig, self._on_signal)
        for sig in set(inherited) - set(watched):  # PARENT_DEATH_SIGNAL when this handler watches no launcher
            if stop_signals.is_start_handler(signal.getsignal(sig)):
                signal.signal(sig, inherited[sig])
        if pending is not None:
            self._on_signal(pending, None)
        elif stop_signals.launcher_gone():
            self._on_signal(PARENT_DEATH_SIGNAL, None)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self.launcher is not None:
            stop_signals.stop_watching()

    @property
    def requested(self) -> bool:
        """A stop was asked for; also true once the launcher is gone (checked here, at every step)."""
        if self.signum is None and self.launcher is not None and stop_signals.launcher_gone():
            self._launcher_gone()
        return self.signum is not None

    def _launcher_gone(self) -> None:
        self.signum = stop_signals.LAUNCHER_GONE_SIGNUM
        self.why = stop_signals.launcher_why(self.launcher)
        logger.warning("the launcher (pid %d) is gone: saving state after the current step, then stopping",
                       self.launcher)

    def _on_signal(self, signum, frame) -> None:
        launcher_gone = signum == PARENT_DEATH_SIGNAL and signum not in SIGNALS
        if launcher_gone and (self.signum is not None or not stop_signals.launcher_gone()):
            # A stop is already under way (the web UI's SIGINT to the group also ends the launcher: that is not a
            # second request), or the launcher's thread that started this process ended and the launcher lives on.
            return
        if not self.in_loop or self.signum is not None:
            when = "before training started" if not self.in_loop else "a second time, during a step"
            if self.signum is None and launcher_gone:
                self.signum, self.why = stop_signals.LAUNCHER_GONE_SIGNUM, stop_signals.launcher_why(self.launcher)
            elif self.signum is None:
                self.signum, self.why = signum, stop_signals.signal_why(signum)
            raise StopRequested(self.signum, when, self.why)
        if launcher_gone:
            self._launcher_gone()
            return
        self.signum = signum
        self.why = stop_signals.signal_why(signum)
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
