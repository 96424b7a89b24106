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


# Where a family may be named by a literal: its package, the tests, docs, templates, and its entry scripts
# (the scripts of ModelFamily.scripts are the family's entry points: `train_network.main("flux")` is how a script
# says which family it is).
FAMILY_LITERALS_ALLOWED = ("library/families/", "tests/", "docs/", "webui/templates/")
# Step benches each measure one family's step against its bare diffusers reference, as tests do.
FAMILY_LITERALS_IN_BENCHES = "bench/"
# The web UI imports no trainer code (import-linter), so it cannot ask the registry; it keeps these tables until the
# form reads the family facts from --describe_flags. Removed when the form reads --describe_flags.
FAMILY_LITERALS_WAITING_FOR_DESCRIBE_FLAGS = (
    "webui/jobfiles.py",  # SCRIPTS, MODEL_TYPES: ModelFamily.scripts / model_types
    "webui/performance.py",  # BLOCK_SWAP_FAMILIES: ModelFamily.supports_block_swap()
    "webui/static/form.js",  # TE_NAMES, DENOISER_NAMES: text_encoder_labels / denoiser_label; per-family fields
)


def _family_literals() -> set[str]:
    from library.families import get_family, family_names

    names = set(family_names())
    for name in family_names():
        family = get_family(name)
        names.update(p.removeprefix("tiny:") for p in family.tiny_presets)  # make_tiny_model's "sd1", "sd2-v"
        names.update(t for t in family.model_types if t)  # --model_type values
    return names


def _entry_scripts() -> set[str]:
    from library.families import registered_families

    return {script for family in registered_families() for script in family.scripts.values()}


def family_literals_in(path: str, literals: set[str]) -> list[str]:
    """String constants of a .py file (or quoted words of a .js file) that are exactly a family's name."""
    rel = os.path.relpath(path, ROOT)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".js"):
        import re

        return [f"{rel}:{n}: {m.group(1)!r}" for n, line in enumerate(text.splitlines(), 1)
                for m in re.finditer(r"""["']([\w.-]+)["']""", line) if m.group(1) in literals]
    return [f"{rel}:{node.lineno}: {node.value!r}" for node in ast.walk(ast.parse(text, rel))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in literals]


def _family_literal_offenders(allowed: tuple[str, ...]) -> dict[str, list[str]]:
    literals, scripts = _family_literals(), _entry_scripts()
    found = {}
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("node_modules", "__pycache__")]
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if not name.endswith((".py", ".js")) or rel.startswith(allowed) or rel in scripts:
                continue
            hits = family_literals_in(path, literals)
            if hits:
                found[rel] = hits
    return found


def test_no_family_name_literal_outside_the_family_packages():
    """A family is named in its package; everything else asks the registry (ModelFamily facts)."""
    offenders = _family_literal_offenders(FAMILY_LITERALS_ALLOWED + (FAMILY_LITERALS_IN_BENCHES,)
                                          + FAMILY_LITERALS_WAITING_FOR_DESCRIBE_FLAGS)
    assert offenders == {}


def test_the_web_ui_allow_list_is_not_stale():
    """Each web UI file on the allow-list still names families (take it off the list once it does not)."""
    found = _family_literal_offenders(FAMILY_LITERALS_ALLOWED + (FAMILY_LITERALS_IN_BENCHES,))
    assert sorted(found) == sorted(FAMILY_LITERALS_WAITING_FOR_DESCRIBE_FLAGS)


def test_the_family_literal_scan_finds_a_literal(tmp_path):
    path = tmp_path / "tool.py"
    path.write_text('x = "flux"\ny = "flux_train_network.py"  # a script name is not a family name\nz = "sdxl"\n')
    assert [hit.split(": ", 1)[1] for hit in family_literals_in(str(path), _family_literals())] == ["'flux'",
                                                                                                    "'sdxl'"]


def test_one_package_per_family_and_few_modules_beside_them():
    from library.families import family_names

    folder = os.path.join(ROOT, "library", "families")
    modules = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    packages = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n, "__init__.py")))
    assert len(modules) <= 6, modules
    assert packages == sorted([*family_names(), "common"])
