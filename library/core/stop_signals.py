"""Stop requests from an entry script's first line on, and a launcher's death as one (standard library only).

An entry script spends its first seconds importing torch, diffusers and the library before `run_training`
installs the run's stop handler (library/train/stopping.py). `install_at_start()`, the first statement of
every entry script, records a SIGINT / SIGTERM that arrives meanwhile; the run's handler takes the recorded
request over (`take_over()`) and stops with its one line before anything is read or written. A second signal
during the imports stops at once, with the same line (nothing has been written yet).

An inherited SIG_IGN is replaced on purpose: the web UI, launchers and `kill -INT` stop a run with SIGINT,
and a job started with `&` by a non-interactive shell inherits SIGINT ignored; a stop request must not be
lost (the run then stops cleanly and saves its state, which a resume continues).

A process started by a launcher (torchrun, `accelerate launch`, DeepSpeed's) also stops when that launcher
is gone (`watch_launcher()`): on Linux the kernel sends PARENT_DEATH_SIGNAL when it exits
(prctl PR_SET_PDEATHSIG), and the loop compares os.getppid() with the launcher's pid at every step (any
system). A plain `python train_network.py` is never watched: its parent is a shell, and a shell that exits
(nohup, screen, a closed terminal) must not stop a run.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Mapping, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What Linux sends when the launcher exits. Its own signal, not SIGTERM: the kernel also sends it when the
# launcher's *thread* that started this process ends, so the handler checks that the parent really changed.
PARENT_DEATH_SIGNAL: Optional[int] = getattr(signal, "SIGUSR2", None)
PR_SET_PDEATHSIG = 1
# The exit status of a run stopped because its launcher is gone: 128 + SIGHUP, as for a lost terminal.
LAUNCHER_GONE_SIGNUM = int(getattr(signal, "SIGHUP", 1))

_inherited: dict[int, object] = {}  # the dispositions install_at_start replaced (SIG_DFL, SIG_IGN, ...)
_pending: list[int] = []  # signals recorded before the run's handler took over
_start_ppid: Optional[int] = None  # os.getppid() when install_at_start ran (the launcher, if any)
_launched: Optional[bool] = None  # decided once, at start, while the launcher can still be seen
_watched: Optional[int] = None  # the launcher pid being watched (watch_launcher)


def stopped_line(why: str, when: str = "before training started") -> str:
    """The one line of a run stopped before its loop: `stopped by signal 2 before training started; ...`."""
    return f"stopped {why} {when}; nothing more was saved"


def signal_why(signum: int) -> str:
    return f"by signal {signum}"


def launcher_why(pid: Optional[int]) -> str:
    return f"because its launcher (pid {pid}) is gone"


def install_at_start() -> None:
    """Record SIGINT / SIGTERM from now until the run's handler takes over; start watching the launcher.

    Called first by every entry script, before the heavy imports. Only in the main thread (signals are
    delivered there); a second call does nothing."""
    global _start_ppid, _launched
    if _inherited or not _main_thread():
        return
    _start_ppid = os.getppid()
    _launched = _started_by_launcher(os.environ)
    for sig in STOP_SIGNALS:
        _inherited[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal_at_start)
    if _launched and PARENT_DEATH_SIGNAL is not None:
        _inherited[PARENT_DEATH_SIGNAL] = signal.getsignal(PARENT_DEATH_SIGNAL)
        signal.signal(PARENT_DEATH_SIGNAL, _on_signal_at_start)
        watch_launcher()
        if launcher_gone():  # it died before the kernel knew to tell us
            _pending.append(PARENT_DEATH_SIGNAL)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _on_signal_at_start(signum, frame) -> None:
    if signum == PARENT_DEATH_SIGNAL and signum not in STOP_SIGNALS and (_pending or not launcher_gone()):
        return  # a stop is already asked for, or the launcher's thread that started us ended (the launcher lives on)
    if _pending:  # asked twice while importing: stop now, nothing has been written yet
        first = _pending[0]
        why = launcher_why(_watched) if first == PARENT_DEATH_SIGNAL else signal_why(first)
        os.write(2, (stopped_line(why) + "\n").encode())
        os._exit(128 + (LAUNCHER_GONE_SIGNUM if first == PARENT_DEATH_SIGNAL else first))
    _pending.append(signum)


def is_start_handler(handler) -> bool:
    return handler is _on_signal_at_start


def take_over() -> tuple[Optional[int], dict[int, object]]:
    """For the run's handler: the first request recorded since start (a signal number, PARENT_DEATH_SIGNAL when
    the launcher is gone; None when none came) and the dispositions install_at_start replaced."""
    first = _pending[0] if _pending else None
    _pending.clear()
    return first, dict(_inherited)


def _started_by_launcher(env: Mapping[str, str]) -> bool:
    """torchrun / accelerate's multi-process launch / DeepSpeed set LOCAL_RANK (torchrun also TORCHELASTIC_RUN_ID)
    in each worker it starts itself. accelerate's one-process launch sets ACCELERATE_USE_CPU and
    ACCELERATE_MIXED_PRECISION; those can also sit in a user's shell profile, so there the parent must be
    `accelerate` itself (Linux: its command line; elsewhere the variables decide)."""
    if env.get("TORCHELASTIC_RUN_ID") or env.get("LOCAL_RANK"):
        return True
    if "ACCELERATE_USE_CPU" in env and "ACCELERATE_MIXED_PRECISION" in env:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                return b"accelerate" in f.read()
        except OSError:
            return not sys.platform.startswith("linux")
    return False


def watch_launcher(env: Mapping[str, str] = os.environ) -> Optional[int]:
    """Start watching the launcher when one started this process; returns its pid (None: not launched).

    The pid is the parent's at install_at_start (the launcher: it started us), or now when that never ran."""
    global _watched
    launched = _launched if _start_ppid is not None else _started_by_launcher(env)
    if not launched:
        return None
    _watched = _start_ppid if _start_ppid is not None else os.getppid()
    _set_parent_death_signal(PARENT_DEATH_SIGNAL or 0)
    return _watched


def stop_watching() -> None:
    global _watched
    if _watched is not None:
        _set_parent_death_signal(0)
    _watched = None


def launcher_gone() -> bool:
    """True once the watched launcher has exited (this process was handed to another parent). A getppid() call."""
    return _watched is not None and os.getppid() != _watched


def _set_parent_death_signal(signum: int) -> bool:
    """Linux: have the kernel send `signum` when the parent exits (0: no longer). False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
