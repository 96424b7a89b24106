"""The GPUs of this machine, from nvidia-smi (the UI imports no torch)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

_QUERY = "index,name,memory.total,memory.used,utilization.gpu"


def gpus(timeout: float = 10) -> list[dict[str, Any]]:
    """[{index, name, memory_total_mib, memory_used_mib, utilization_percent}]; [] without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        result = subprocess.run([exe, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return parse_nvidia_smi(result.stdout)


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue

        def number(value: str) -> Any:
            try:
                return int(float(value))
            except ValueError:
                return None

        out.append({"index": number(parts[0]), "name": parts[1], "memory_total_mib": number(parts[2]),
                    "memory_used_mib": number(parts[3]), "utilization_percent": number(parts[4])})
    return out


def process_group_memory(pgid: int) -> dict[str, Any]:
    """Resident memory (MiB) and CPU time of the processes in a run's process group, from /proc (standard
    library): the trainer, its launcher and data-loader workers."""
    import os

    rss_kib, count = 0, 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {"processes": 0, "rss_mib": None}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[2]) != pgid:  # field 5: the process group
                continue
            with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss_kib += int(line.split()[1])
                        break
            count += 1
        except (OSError, ValueError, IndexError):
            continue
    return {"processes": count, "rss_mib": round(rss_kib / 1024, 1) if count else None}
