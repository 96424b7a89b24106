"""--describe_flags: every training script prints each of its flags once, as declared (name, type, default,
choices, help, group, range), with its family's facts, and exits 0 before anything loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from library.cli.config_file import parse_with_config_file
from library.cli.describe import FLAG_KEYS, describe
from library.cli.entry import build_parser, run_training
from library.cli.options import options_from_values
from library.cli.ranges import RANGES, check_ranges
from library.families import get_family
from library.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_KEYS = {"schema", "script", "mode", "family", "groups", "flags"}
TYPES = {"bool", "int", "float", "str"}


def _scripts() -> list[tuple[str, str, bool]]:
    """(script, family, fine_tune) of every training entry script, read from its run_training call."""
    out = []
    for name in sorted(os.listdir(ROOT)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            text = f.read()
        match = re.search(r'run_training\("(\w+)"', text)
        if match:
            out.append((name, match.group(1), "fine_tune=True" in text))
    return out


SCRIPTS = _scripts()


def test_the_scripts_are_found():
    from library.families import registered_families

    # every entry script a family declares, found by the scan (one per script: a family that shares its scripts, as
    # Chroma the FLUX.1 ones, adds none)
    assert {name for name, _, _ in SCRIPTS} == {s for f in registered_families() for s in f.scripts.values()}
    assert len(SCRIPTS) >= 16
    assert ("train_network.py", "sd", False) in SCRIPTS and ("flux_train.py", "flux", True) in SCRIPTS


def _check_schema(doc: dict) -> None:
    assert set(doc) == TOP_KEYS and doc["schema"] == 1
    assert doc["groups"] == list(dict.fromkeys(f["group"] for f in doc["flags"]))
    for flag in doc["flags"]:
        assert tuple(flag) == FLAG_KEYS, flag["name"]
        assert flag["type"] in TYPES and isinstance(flag["help"], str) and flag["help"], flag["name"]
        assert isinstance(flag["takes_value"], bool) and isinstance(flag["many"], bool)
        assert flag["choices"] is None or (isinstance(flag["choices"], list) and flag["choices"])
        if flag["choices"] and flag["default"] is not None:
            assert flag["default"] in flag["choices"], flag["name"]
        if not flag["takes_value"]:
            assert flag["type"] == "bool" and flag["default"] is False
        if flag["range"] is not None:
            assert flag["type"] in ("int", "float") and set(flag["range"]) == {
                "lo", "hi", "lo_open", "hi_open", "integer", "note", "text"}


def test_train_network_describes_every_flag_and_exits_0():
    """The real script, as the web UI runs it: JSON on stdout, exit 0, at least 150 flags, nothing loaded
    (a --config_file that does not exist is not even read)."""
    argv = [sys.executable, "train_network.py", "--describe_flags", "--config_file", "/nonexistent.toml"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    _check_schema(doc)
    assert doc["script"] == "train_network.py" and doc["mode"] == "lora" and doc["family"]["name"] == "sd"
    assert len(doc["flags"]) >= 150
    flags = {f["name"]: f for f in doc["flags"]}
    assert flags["network_dim"] == {
        "name": "network_dim", "type": "int", "default": 4, "choices": None,
        "help": "LoRA rank (default 4, as sd-scripts)", "group": "network",
        "range": {"lo": 1, "hi": None, "lo_open": False, "hi_open": False, "integer": True, "note": "",
                  "text": "an integer >= 1"},
        "aliases": [], "takes_value": True, "many": False}
    assert flags["zero_terminal_snr"]["aliases"] == ["rescale_zero_terminal_snr"]
    assert flags["text_encoder_lr"]["many"] and flags["text_encoder_lr"]["type"] == "float"
    assert flags["save_ema_only"]["default"] is True and flags["save_ema_only"]["takes_value"]


@pytest.mark.parametrize("script,family,fine_tune", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_every_script_describes_each_argparse_flag_exactly_once(script, family, fine_tune, monkeypatch, capsys):
    """Each entry script (run in-process as its __main__ does): exit 0 without building a trainer; each option
    string argparse knows is described once (as a name or an alias); the family and mode are the script's."""
    monkeypatch.setattr(sys, "argv", [script])
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("the trainer was built"))
    ti = "textual_inversion" in script  # its entry script passes textual_inversion=True
    with pytest.raises(SystemExit) as e:
        run_training(family, "describe", ["--describe_flags"], fine_tune=fine_tune, textual_inversion=ti)
    assert e.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    _check_schema(doc)
    mode = "textual_inversion" if ti else "fine_tune" if fine_tune else "lora"
    assert (doc["script"], doc["family"]["name"], doc["mode"]) == (script, family, mode)
    described = [f"--{n}" for f in doc["flags"] for n in (f["name"], *f["aliases"])]
    parser = build_parser("describe", get_family(family), fine_tune, textual_inversion=ti)
    known = [o for a in parser._actions if a.dest != "help" for o in a.option_strings]
    assert len(described) == len(set(described))  # none twice
    assert sorted(described) == sorted(known)
    assert [f["name"] for f in doc["flags"]] == [a.dest for a in parser._actions if a.dest != "help"]  # one per dest


@pytest.mark.parametrize("family,fine_tune", [("sd", False), ("sdxl", True), ("flux", False), ("sd3", True)])
def test_defaults_round_trip(family, fine_tune, tmp_path):
    """The described default is what a run gets without the flag: the parser's default for the core flags, the
    options dataclass's for the family's own; a config file holding every described default changes nothing,
    and every default passes the range checks."""
    fam = get_family(family)
    parser = build_parser("t", fam, fine_tune)
    doc = describe(parser.flag_specs, fam, "t", fine_tune)
    family_names = {f["name"] for f in doc["flags"] if f["group"] == f"{family} model"}
    bare = parse_with_config_file(parser, [])
    family_options = options_from_values(fam.options_type, vars(bare))
    for flag in doc["flags"]:
        value = _nested(family_options, flag["name"]) if flag["name"] in family_names else getattr(bare, flag["name"])
        expected = tuple(flag["default"]) if isinstance(value, tuple) else flag["default"]
        assert value == expected and type(value) is type(expected), flag["name"]
    skip = {"config_file", "output_config", "check_config", "describe_flags"}
    lines = [f"{f['name']} = {json.dumps(f['default'])}" for f in doc["flags"]
             if f["default"] is not None and f["name"] not in skip]
    config = tmp_path / "defaults.toml"
    config.write_text("\n".join(lines) + "\n")
    from_file = parse_with_config_file(build_parser("t", fam, fine_tune), ["--config_file", str(config)])
    for flag in doc["flags"]:
        if flag["name"] in skip:
            continue
        if flag["name"] in family_names:  # unset on the command line: None, the dataclass default when built
            assert _nested(options_from_values(fam.options_type, vars(from_file)), flag["name"]) == flag["default"]
        else:
            assert getattr(from_file, flag["name"]) == getattr(bare, flag["name"]), flag["name"]
    check_ranges(vars(from_file))


def _nested(options, name):
    """The value of flag `name` in an options dataclass whose nested dataclasses hold flags too."""
    import dataclasses

    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name == name:
            return value
        if dataclasses.is_dataclass(value):
            try:
                return _nested(value, name)
            except KeyError:
                pass
    raise KeyError(name)


def test_ranges_and_described_ranges_agree():
    """The range a flag describes is the one check_ranges applies (one declaration)."""
    for family, fine_tune in (("sd", False), ("flux", True)):
        parser = build_parser("t", get_family(family), fine_tune)
        for flag in describe(parser.flag_specs)["flags"]:
            rule = RANGES.get(flag["name"])
            assert (flag["range"] is None) == (rule is None), flag["name"]
            if rule is not None:
                assert flag["range"]["text"] == rule.describe()


def test_family_facts_are_included_when_the_family_declares_them():
    class WithFacts:
        name = "demo"

        @classmethod
        def facts(cls):
            return {"scripts": ("demo_train.py",), "block_swap": True}

    class WithoutFacts:
        name = "plain"

    assert describe([], WithFacts(), "demo_train.py")["family"] == {
        "name": "demo", "scripts": ["demo_train.py"], "block_swap": True}
    assert describe([], WithoutFacts(), "x.py")["family"] == {"name": "plain"}


def test_config_file_values_are_checked_against_choices(tmp_path, capsys):
    """A config file's value outside a flag's choices is refused as the command line's is: one line, exit 2."""
    config = tmp_path / "c.toml"
    config.write_text('[training]\nsave_precision = "fp64"\n')
    argv = ["--config_file", str(config), "--pretrained_model_name_or_path", "tiny:sd1", "--output_dir",
            str(tmp_path / "out")]
    assert run_training("sd", "t", argv) == 2
    assert capsys.readouterr().err == "error: --save_precision: expected one of float, fp16, bf16, got 'fp64'\n"
    config.write_text("max_token_length = \"150\"\n")  # a string that argparse converts is a valid choice
    ns = parse_with_config_file(build_parser("t", get_family("sd")), ["--config_file", str(config)])
    assert ns.max_token_length == 150


def test_web_ui_reads_the_description_once(tmp_path):
    """webui.performance learns a script's flags (with their other names) from --describe_flags, once; a script
    that cannot say gives no flags and is asked again."""
    from webui import performance

    doc = {"flags": [{"name": "a_flag", "aliases": ["old_name"]}, {"name": "b_flag", "aliases": []}]}
    script = tmp_path / "fake_train.py"
    count = tmp_path / "count"
    script.write_text("import json, sys, pathlib\n"
                      f"p = pathlib.Path({str(count)!r})\n"
                      "p.write_text(str(int(p.read_text()) + 1) if p.exists() else '1')\n"
                      "assert sys.argv[1:] == ['--describe_flags']\n"
                      f"print(json.dumps({doc!r}))\n")
    assert performance.trainer_flags(str(script)) == {"a_flag", "old_name", "b_flag"}
    assert performance.trainer_flags(str(script)) == {"a_flag", "old_name", "b_flag"}
    assert count.read_text() == "1"
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nsys.exit(1)\n")
    assert performance.trainer_flags(str(broken)) == frozenset()
    broken.write_text(f"print({json.dumps(json.dumps(doc))})\n")
    assert performance.trainer_flags(str(broken)) == {"a_flag", "old_name", "b_flag"}  # asked again
