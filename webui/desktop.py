"""Open a job's folder in the desktop's file manager, when the browser and the server are on one machine.

The server only ever opens its own job folders, only for a request from a loopback address, and only with the
platform's own opener (`xdg-open` on Linux / BSD, `open` on macOS, the shell's `startfile` on Windows) given the
path as one argument (no shell). Anything else is a reason, not an attempt.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from typing import Optional

OPENERS = {"darwin": "open"}  # everything else but Windows: xdg-open


def is_loopback(host: Optional[str]) -> bool:
    """Whether `host` (an address, or "localhost") is this machine's loopback (the server's bind check too)."""
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def opener_problem(client_host: Optional[str], platform: str = sys.platform, environ=os.environ) -> Optional[str]:
    """Why the folder cannot be opened for this request (None: it can)."""
    if not is_loopback(client_host):
        return "the folder opens on the server's desktop: only from a browser on the same machine (a loopback address)"
    if platform.startswith("win"):
        return None
    opener = OPENERS.get(platform, "xdg-open")
    if shutil.which(opener, path=environ.get("PATH")) is None:
        return f"no {opener} on the server to open folders with"
    if opener == "xdg-open" and not (environ.get("DISPLAY") or environ.get("WAYLAND_DISPLAY")):
        return "the server has no desktop session (DISPLAY / WAYLAND_DISPLAY are not set)"
    return None


def open_folder(path: str, platform: str = sys.platform, environ=os.environ) -> None:
    """Hand `path` to the desktop's opener and return at once (the opener runs on its own)."""
    if platform.startswith("win"):
        os.startfile(path)  # type: ignore[attr-defined]  # the Windows shell's "open"
        return
    opener = shutil.which(OPENERS.get(platform, "xdg-open"), path=environ.get("PATH"))
    subprocess.Popen([opener, path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, env=dict(environ))
