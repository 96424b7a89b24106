"""The layer rules of docs/architecture.md hold: import-linter's contracts in .importlinter are all kept."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    result = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "7 kept, 0 broken" in result.stdout


def test_no_flags_namespace_below_the_cli_layer():
    """Components take typed settings; only library/cli sees the parsed flags."""
    offenders = []
    for package in ("library/train", "library/data", "library/families", "library/sampling", "library/objectives",
                    "library/core", "networks"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        for n, line in enumerate(f, 1):
                            if "flags." in line.split("#")[0] or "Namespace" in line:
                                offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert offenders == []
