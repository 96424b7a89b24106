"""The job's train.log: progress parsed from the trainer's progress bar, and the lines for the live console."""

from __future__ import annotations

import os
import re
from typing import Any, Optional

# tqdm: "steps:  50%|#####     | 4/8 [00:26<00:24,  6.02s/it, loss=1.1025, lr=1.00e-03]"
_BAR_RE = re.compile(r"steps:\s*(\d+)%\|[^|]*\|\s*(\d+)/(\d+)\s*\[([0-9:]+)<([0-9:?]+)(?:,\s*([^,\]]+))?([^\]]*)\]")
_KV_RE = re.compile(r"(\w+)=([^,\]\s]+)")
WAITING = "Waiting for training to start..."


def _bar_values(m: re.Match) -> dict[str, Any]:
    out: dict[str, Any] = {"percent": int(m.group(1)), "step": int(m.group(2)), "total": int(m.group(3)),
                           "elapsed": m.group(4), "eta": m.group(5), "rate": (m.group(6) or "").strip() or None}
    for key, value in _KV_RE.findall(m.group(7) or ""):
        try:
            out[key] = float(value)
        except ValueError:
            out[key] = value
    return out


_VAL_RE = re.compile(r"validation loss at (step|epoch) (\d+): ([0-9.eE+-]+|nan|inf)")


def history(log_path: str) -> list[dict[str, Any]]:
    """Loss and LR by step over every run in the log (the last value shown for a step wins), for the chart;
    `val_loss` at the steps where a validation loss was logged (one at an epoch's end: its last step)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    by_step: dict[int, dict[str, Any]] = {}
    last_step = 0
    events = sorted([(m.start(), "bar", m) for m in _BAR_RE.finditer(text)]
                    + [(m.start(), "val", m) for m in _VAL_RE.finditer(text)], key=lambda e: e[0])
    for _, kind, m in events:
        if kind == "bar":
            values = _bar_values(m)
            last_step = values["step"]
            if "loss" in values:
                entry = by_step.setdefault(values["step"], {"step": values["step"]})
                entry.update(loss=values["loss"], lr=values.get("lr"))
        else:
            step = int(m.group(2)) if m.group(1) == "step" else last_step
            by_step.setdefault(step, {"step": step, "loss": None, "lr": None})["val_loss"] = float(m.group(3))
    return [by_step[k] for k in sorted(by_step)]


def progress(log_path: str, tail_bytes: int = 65536) -> Optional[dict[str, Any]]:
    """Step, total, elapsed, ETA, rate, loss and LR from the newest progress bar in the log, or None."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - tail_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    bars = list(_BAR_RE.finditer(text))
    if not bars:
        return None
    return _bar_values(bars[-1])


_BAR_THEN_TEXT = re.compile(r"^(steps:[^\]]*\])(\S.*)$")


def split_lines(text: str) -> list[str]:
    """Lines ended by \n or tqdm's \r; a log line written right after a bar (no newline between) is its own."""
    out = []
    for line in re.split(r"\r\n|\r|\n", text):
        m = _BAR_THEN_TEXT.match(line)
        out.extend(m.groups() if m else [line])
    return [line for line in out if line.strip()]


def read_lines(log_path: str, offset: int, limit: int = 1 << 20) -> tuple[list[str], int, str]:
    """Complete lines of the log from byte `offset`, the offset after them, and the unfinished rest (the
    progress bar tqdm is redrawing: it ends with the next \r)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except OSError:
        return [], offset, ""
    end = max(data.rfind(b"\n"), data.rfind(b"\r"))
    rest = data[end + 1:].decode("utf-8", errors="replace")
    if end < 0:
        return [], offset, rest
    return split_lines(data[:end + 1].decode("utf-8", errors="replace")), offset + end + 1, rest
