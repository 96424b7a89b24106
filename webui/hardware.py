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
