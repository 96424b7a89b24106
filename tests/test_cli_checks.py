"""Command-line checks before any work: writable output folders and the parser's
abbreviations, one-line errors and suggestions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from library.cli.config_file import parse_with_config_file
from library.cli.entry import build_parser, run_training
from library.families import get_family
from library.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_DATA = os.path.join(ROOT, "examples", "data", "train")


def _argv(out: str, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir", EXAMPLE_DATA,
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", out, *extra]


@pytest.fixture
def no_training(monkeypatch):
    """Trainer.run must never be reached: the checks come before the data scan and model load."""
    def run(self):
        raise AssertionError("the trainer started: the check must come before anything loads")
    monkeypatch.setattr(Trainer, "run", run)


def _bad_dirs(tmp_path) -> list[tuple[str, str, str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return [
        (str(a_file), "is a file, not a folder", "file"),
        (str(a_file / "sub"), "cannot create the folder", "under a file"),
        ("/proc/lora-out", "cannot create the folder", "under /proc"),
        ("/proc", "the folder is not writable", "/proc itself"),
    ]


def test_unwritable_output_dir_is_one_line_before_anything_loads(tmp_path, capsys, no_training):
    """--output_dir that is a file, under a file or under /proc: one line naming flag and path, exit 2,
    before the dataset scan and the model load (the trainer is never run)."""
    for path, why, case in _bad_dirs(tmp_path):
        code = run_training("sd", "test", _argv(path))
        err = capsys.readouterr().err.strip()
        assert code == 2, case
        assert err.startswith(f"error: --output_dir {path}: {why}"), (case, err)
        assert len(err.splitlines()) == 1, case


def test_unwritable_logging_dir_is_one_line(tmp_path, capsys, no_training):
    """The same check for --logging_dir; the probe file is removed from a good --output_dir."""
    out = tmp_path / "out"
    code = run_training("sd", "test", _argv(str(out), "--logging_dir", "/proc/lora-logs"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --logging_dir /proc/lora-logs: cannot create the folder")
    assert not out.exists()  # created to probe it, then removed: a run that never started leaves nothing


def test_writable_output_dir_check_leaves_nothing_behind(tmp_path):
    """A missing --output_dir passes (created, probed, removed again); an existing one keeps no probe."""
    from library.cli.preflight import check_writable_dir

    check_writable_dir("--output_dir", str(tmp_path / "new" / "deeper"))
    assert os.listdir(tmp_path) == []
    (tmp_path / "there").mkdir()
    check_writable_dir("--output_dir", str(tmp_path / "there"))
    assert os.listdir(tmp_path / "there") == []


def _parser():
    return build_parser("test", get_family("sd"))


def test_unambiguous_abbreviations_are_accepted_as_in_sd_scripts(tmp_path):
    """argparse's default allow_abbrev, which sd-scripts users' scripts rely on."""
    ns = parse_with_config_file(_parser(), ["--network_di", "16", "--learning_r", "2e-4", "--output_dir", "x"])
    assert ns.network_dim == 16 and ns.learning_rate == 2e-4


def test_misspelt_flag_is_one_line_with_the_closest_name(capsys):
    """One line, the suggestion, exit 2, no usage dump."""
    with pytest.raises(SystemExit) as e:
        parse_with_config_file(_parser(), ["--network_alpah", "4", "--output_dir", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err == "error: unrecognized argument --network_alpah; did you mean --network_alpha?\n"


def test_unknown_flags_and_ambiguous_abbreviation_messages(capsys):
    """Several unknown flags in one line; no suggestion when nothing is close; an ambiguous
    abbreviation is one line too."""
    with pytest.raises(SystemExit):
        parse_with_config_file(_parser(), ["--lerning_rate=1", "--qqqzzy"])
    assert capsys.readouterr().err == ("error: unrecognized arguments --lerning_rate; did you mean --learning_rate?; "
                                       "--qqqzzy (--help lists every flag)\n")
    with pytest.raises(SystemExit):
        parse_with_config_file(_parser(), ["--network", "4"])
    err = capsys.readouterr().err
    assert err.startswith("error: ambiguous option: --network could match") and err.count("\n") == 1


def test_misspelt_flag_from_the_command_line_subprocess():
    """The real script: exit code 2 and exactly one line on stderr."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_network.py"), "--network_alpah", "4"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "error: unrecognized argument --network_alpah; did you mean --network_alpha?"
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1


def test_unknown_config_file_keys_are_all_reported(tmp_path, capsys):
    """Every unknown --config_file key, one line each with a suggestion (sd-scripts ignores them)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[network]\nnetwork_alpah = 4\nnetwork_dimm = 8\n")
    code = run_training("sd", "test", ["--config_file", str(cfg)])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {cfg}: network.network_alpah: unknown flag (did you mean network_alpha?)",
        f"{cfg}: network.network_dimm: unknown flag (did you mean network_dim?)",
    ]


def test_output_name_must_be_a_file_name_not_a_path(tmp_path, capsys, no_training):
    """--output_name is joined to --output_dir for the model, its states and <name>_config.toml, so a
    path there wrote outside the folder (`../../../outside/pwn` three levels up). A folder part, `..`, an absolute
    path, an empty name or a NUL is one line naming the flag, exit 2, before anything loads; nothing is written."""
    out = tmp_path / "a" / "b" / "out"
    for name, problem in (("../../../outside/pwn", "is a path"), (str(tmp_path / "abs"), "is a path"),
                          ("sub/lora", "is a path"), ("..", "is a path"), ("win\\lora", "is a path"),
                          ("", "is empty"), ("lo\0ra", "contains a NUL character")):
        code = run_training("sd", "test", _argv(str(out), "--output_name", name))
        err = capsys.readouterr().err.strip()
        assert code == 2, name
        assert err == (f"error: --output_name {name!r}: {problem}; expected a file name such as my_lora "
                       "(no '/', '\\' or '..'; the folder is --output_dir)"), err
    assert os.listdir(tmp_path) == []
    for name in ("my_lora", "my.lora-v2", "..lora"):  # names with dots stay names
        code = run_training("sd", "test", _argv(str(out), "--output_name", name, "--check_config"))
        assert code == 0, (name, capsys.readouterr().err)


def test_log_prefix_and_tracker_name_must_be_names_not_paths(tmp_path, capsys, no_training):
    """--log_prefix and --log_tracker_name are joined to --logging_dir as one folder name, so a path there put the
    logs outside it (`../x`, an absolute path): one line naming the flag, exit 2, nothing written."""
    out = tmp_path / "out"
    for flag_name, example in (("--log_prefix", "run1_"), ("--log_tracker_name", "network_train")):
        for name in ("../escape", str(tmp_path / "abs"), "a/b"):
            code = run_training("sd", "test", _argv(str(out), flag_name, name))
            err = capsys.readouterr().err.strip()
            assert code == 2, name
            assert err == (f"error: {flag_name} {name!r}: is a path; expected a file name such as {example} "
                           "(no '/', '\\' or '..'; the folder is --logging_dir)"), err
    assert os.listdir(tmp_path) == []
    code = run_training("sd", "test", _argv(str(out), "--log_prefix", "run1_", "--log_tracker_name", "mine",
                                            "--check_config"))
    assert code == 0, capsys.readouterr().err
