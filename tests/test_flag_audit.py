"""Every flag of every training parser is read when the run's settings are built.

The namespace is wrapped so that each attribute read (and each key read through vars()) is recorded; the
settings are built once with the defaults and once with each on/off flag turned on (a flag read only when
another one is on counts). Iterating a namespace (range checks, the metadata copy in RECORDED_FLAGS) is not
a read: a flag used only for metadata or accepted only for compatibility must be listed below, with why.
"""

import argparse
import json
import os

import pytest

from library.cli.entry import build_parser, settings_from_args
from library.cli.training import COMPATIBILITY_FLAGS
from library.core.errors import UserError
from library.core.metadata import RECORDED_FLAGS
from library.families import get_family

# Flags the parser layer consumes itself (library/cli/config_file.py parse_with_config_file).
PARSER_ONLY = {
    "config_file": "its TOML becomes the parser's defaults before parsing",
    "output_config": "writes the flags to --config_file and exits before any settings are built",
    "check_config": "read by the entry script after the settings are built: print 'config ok' and exit",
    "describe_flags": "prints the flags' description and exits before the config file is read",
}
# Flags that change nothing but the ss_* metadata sd-scripts writes for them (none left: --lowram now loads in turns).
METADATA_ONLY: dict[str, str] = {}
# sd-scripts flags accepted for compatibility; library/cli/training.py COMPATIBILITY_FLAGS says why, per run.
COMPATIBILITY_ONLY = {flag: why for flag, why in COMPATIBILITY_FLAGS.items() if flag not in METADATA_ONLY}

PARSERS = [(family, fine_tune) for family in ("sd", "sdxl", "flux") for fine_tune in (False, True)]
PRESETS = {"sd": "tiny:sd1", "sdxl": "tiny:sdxl", "flux": "tiny:flux"}


class _RecordingDict(dict):
    def __init__(self, data, reads):
        super().__init__(data)
        self._reads = reads

    def __getitem__(self, key):
        self._reads.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._reads.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._reads.add(key)
        return super().__contains__(key)


def _recording(ns: argparse.Namespace, reads: set):
    """A copy of `ns` that adds the name of every flag read to `reads` (getattr, hasattr, vars(ns)[...])."""
    class Recording(argparse.Namespace):
        def __getattribute__(self, name):
            if name == "__dict__":
                return _RecordingDict(object.__getattribute__(self, "__dict__"), reads)
            if not name.startswith("__"):
                reads.add(name)
            return object.__getattribute__(self, name)

    out = Recording()
    object.__getattribute__(out, "__dict__").update(vars(ns))
    return out


def unread_flags(family_name: str, fine_tune: bool, parser=None) -> set:
    """The dests of `parser` (default: the training parser) that building the settings never reads."""
    family = get_family(family_name)
    parser = parser or build_parser("audit", family, fine_tune)
    base = ["--pretrained_model_name_or_path", PRESETS[family_name], "--output_dir", "/nonexistent/audit"]
    switches = [a for a in parser._actions if isinstance(a, argparse._StoreTrueAction) and a.dest != "help"]
    reads: set = set()
    for extra in [[]] + [[a.option_strings[0]] for a in switches]:
        ns = parser.parse_args(base + extra)
        try:
            settings_from_args(_recording(ns, reads), family, fine_tune)
        except UserError:
            pass  # a refused combination: what was read up to the refusal still counts
    return {a.dest for a in parser._actions if a.dest != "help"} - reads


@pytest.mark.parametrize("family,fine_tune", PARSERS)
def test_every_training_flag_is_read(family, fine_tune):
    """No flag of sd/sdxl/flux train_network or fine-tune is accepted and then ignored, except
    those listed here with their reason (and the list holds no flag that is in fact read)."""
    parser = build_parser("audit", get_family(family), fine_tune)
    allowed = {**PARSER_ONLY, **METADATA_ONLY, **COMPATIBILITY_ONLY}
    dests = {a.dest for a in parser._actions}
    assert unread_flags(family, fine_tune) == {flag for flag in allowed if flag in dests}
    assert set(METADATA_ONLY) <= set(RECORDED_FLAGS)


def test_audit_finds_an_ignored_flag():
    """The audit itself: a flag nothing reads is reported."""
    parser = build_parser("audit", get_family("sd"))
    parser.add_argument("--never_read", type=int, default=3)
    assert "never_read" in unread_flags("sd", False, parser)


def test_ema_flags_without_use_ema_are_refused(tmp_path, capsys):
    """--ema_decay & co. without --use_ema (they would change nothing): one line, exit 2."""
    from library.cli.entry import run_training

    argv = ["--pretrained_model_name_or_path", "tiny:sd1", "--output_dir", str(tmp_path / "o"),
            "--train_data_dir", str(tmp_path), "--ema_decay", "0.99"]
    assert run_training("sd", "t", argv) == 2
    assert capsys.readouterr().err.strip() == "error: --ema_decay: only used with --use_ema; add --use_ema or drop the flag"


# Settings fields nothing below the CLI layer reads, and why (none today; an entry must name its reason).
UNREAD_FIELDS: dict[str, str] = {}


def _settings_dataclasses():
    import dataclasses
    import typing

    from library.train.settings import RunSettings

    found: set = set()

    def walk(cls):
        if cls in found:
            return
        found.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for tp in (hints[f.name], *typing.get_args(hints[f.name])):
                if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                    walk(tp)

    walk(RunSettings)
    for name in ("sd", "sdxl", "flux"):
        walk(get_family(name).options_type)
    return found


def test_every_settings_field_is_used_below_the_cli():
    """A flag read into the settings can still be dropped there (--persistent_data_loader_workers
    was): every field of RunSettings' dataclasses (and of the families' options) is read as an attribute, or
    named as a string, somewhere in library/ or networks/ outside library/cli."""
    import ast
    import dataclasses
    import glob
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    used: set = set()
    for path in glob.glob(os.path.join(root, "library", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(root, "networks", "**", "*.py"), recursive=True):
        if os.path.relpath(path, root).startswith(os.path.join("library", "cli")):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.add(node.value)
    unread = {f"{cls.__name__}.{f.name}" for cls in _settings_dataclasses() for f in dataclasses.fields(cls)
              if f.name not in used}
    assert {name.split(".")[1] for name in unread} == set(UNREAD_FIELDS), sorted(unread)


# Every long option of sd-scripts 48d368fa's training scripts (tests/data/sd_scripts_flags.json, listed from
# each script's own setup_parser()) is accepted by our script of the same name, or refused on purpose: the flags
# below, each with its reason in docs/differences.md ("Flags not taken").
SD_SCRIPTS_FLAGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sd_scripts_flags.json")
SCRIPT_PARSERS = {
    "train_network.py": ("sd", False), "sdxl_train_network.py": ("sdxl", False),
    "flux_train_network.py": ("flux", False), "sd3_train_network.py": ("sd3", False),
    "lumina_train_network.py": ("lumina", False), "anima_train_network.py": ("anima", False),
    "hunyuan_image_train_network.py": ("hunyuan_image", False), "fine_tune.py": ("sd", True),
    "sdxl_train.py": ("sdxl", True), "flux_train.py": ("flux", True), "sd3_train.py": ("sd3", True),
    "lumina_train.py": ("lumina", True), "anima_train.py": ("anima", True), "train_db.py": ("sd", "db"),
}
REFUSED_SD_SCRIPTS_FLAGS: dict[str, str] = {
    "dataset_class": "sd-scripts' dataset class interface (train_util.BaseDataset subclasses) does not exist here",
    "fused_backward_pass": "LoRA scripts only: sd-scripts accepts it there and ignores it; here it is a fine-tune flag",
    "controlnet_model_name_or_path": "ControlNet training is not implemented; sd-scripts' flux_train_network.py and "
                                     "flux_train.py accept it and ignore it",
}


def _our_flags(script: str) -> set:
    family, mode = SCRIPT_PARSERS[script]
    parser = build_parser("audit", get_family(family), bool(mode), dreambooth=mode == "db")
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


@pytest.mark.parametrize("script", sorted(SCRIPT_PARSERS))
def test_every_sd_scripts_flag_is_taken(script):
    """Every sd-scripts flag of the script is taken or refused on purpose, none is an 'unrecognized argument'
    (372 (script, flag) pairs of 42 distinct flags were)."""
    theirs = set(json.load(open(SD_SCRIPTS_FLAGS, encoding="utf-8"))["scripts"][script])
    missing = theirs - _our_flags(script) - {f"--{name}" for name in REFUSED_SD_SCRIPTS_FLAGS}
    assert sorted(missing) == []


def test_refused_sd_scripts_flags_are_documented():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "differences.md"), encoding="utf-8").read()
    assert [name for name in REFUSED_SD_SCRIPTS_FLAGS if f"`--{name}`" not in text] == []
    assert set(SD_SCRIPTS_FLAGS) and len(json.load(open(SD_SCRIPTS_FLAGS))["scripts"]) == 14
