"""The layer rules of docs/architecture.md hold: import-linter's contracts in .importlinter are all kept."""

import ast
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    result = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "8 kept, 0 broken" in result.stdout


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


def _python_files():
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("node_modules", "__pycache__")]
        for name in names:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _is_project_module(dotted: str) -> bool:
    base = os.path.join(ROOT, *dotted.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: str) -> list[str]:
    """`from m import _name` and `m._name` in one file, where m is a module of this repository."""
    rel = os.path.relpath(path, ROOT)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), rel)
    found, modules = [], {}  # local name -> the project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _is_project_module(node.module):
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{rel}:{node.lineno}: from {node.module} import {alias.name}")
                elif _is_project_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_project_module(alias.name):
                    # `import a.b as m` binds m to a.b; `import a.b` binds a (a.b._x is then a chain)
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else local
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                target = ".".join([modules[value.id], *chain])
                if _is_project_module(target):
                    found.append(f"{rel}:{node.lineno}: {'.'.join([value.id, *chain])}.{node.attr}")
    return sorted(found)


def test_no_module_uses_another_modules_private_names():
    """A `_name` is its module's own: another module (tests included) uses a public name instead."""
    offenders = [use for path in _python_files() for use in private_uses(path)]
    assert offenders == []


def test_the_private_name_scan_finds_both_forms(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "inner.py").write_text("_secret = 1\npublic = 2\n")
    user = tmp_path / "user.py"
    user.write_text("from pkg.inner import _secret, public\nfrom pkg import inner\nimport pkg.inner\n"
                    "x = inner._secret + inner.public + pkg.inner._secret + inner.__name__.__len__()\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert private_uses(str(user)) == ["user.py:1: from pkg.inner import _secret", "user.py:4: inner._secret",
                                       "user.py:4: pkg.inner._secret"]
