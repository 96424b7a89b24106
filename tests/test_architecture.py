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


# vulture at 60% confidence: the only level that reports unused functions, classes, variables and attributes (70% and
# up report only unused imports and unreachable code). Route functions (FastAPI decorators), pytest fixtures and
# hooks are called by their frameworks; the other names read from outside Python's view are in the allow-list.
DEAD_CODE_PATHS = ("library", "networks", "tools", "finetune", "webui", "bench", "tests")
VULTURE_ALLOWLIST = "tests/data/vulture_allowlist.py"


def vulture_findings(root: str = ROOT, extra_paths: tuple = ()) -> list[str]:
    entry_scripts = sorted(name for name in os.listdir(root) if name.endswith(".py"))
    result = subprocess.run(
        [sys.executable, "-m", "vulture", *DEAD_CODE_PATHS, *entry_scripts, *extra_paths, "--min-confidence", "60",
         "--ignore-decorators", "@app.*,@router.*,@*_router.*,@pytest.fixture", "--ignore-names", "pytest_*"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 3), result.stderr[-2000:]  # 3: dead code found
    return result.stdout.splitlines()


def test_no_dead_code():
    """No function, class, variable or attribute is defined and never used (allow-list: tests/data/)."""
    assert os.path.isfile(os.path.join(ROOT, VULTURE_ALLOWLIST))
    assert vulture_findings() == []


def test_dead_code_check_reports_an_unused_function(tmp_path):
    dead = tmp_path / "dead_module.py"
    dead.write_text("def never_called_helper():\n    return 1\n")
    findings = vulture_findings(extra_paths=(str(dead),))
    assert findings == [f"{dead}:1: unused function 'never_called_helper' (60% confidence)"]


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
