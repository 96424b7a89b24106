"""library/core/io_utils.py: atomic writes, temporary names, stale temporaries, file modes."""

import os
import stat
import subprocess
import sys

import pytest
import torch

from library.core import io_utils
from library.core.io_utils import (
    atomic_directory,
    atomic_path,
    clean_stale_temporaries,
    is_temporary_name,
    save_safetensors_atomic,
)
from library.core.metadata import save_lora_state_dict


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_issue20_files_and_folders_respect_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    """Issue 11 item 20: files were written 0600 and folders 0700 whatever the umask."""
    umask(mask)
    f = tmp_path / "a.safetensors"
    save_safetensors_atomic({"x": torch.zeros(2)}, str(f))
    assert _mode(f) == file_mode
    g = tmp_path / "b.txt"
    io_utils.atomic_write_text(str(g), "hi")
    assert _mode(g) == file_mode
    d = tmp_path / "run-state"
    with atomic_directory(str(d)) as tmp:
        with open(os.path.join(tmp, "x"), "w") as fh:
            fh.write("1")
        save_safetensors_atomic({"x": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))
        from safetensors.torch import save_file  # what save_state writes directly inside the folder
        save_file({"x": torch.zeros(2)}, os.path.join(tmp, "direct.safetensors"))
    assert _mode(d) == dir_mode
    assert {_mode(d / n) for n in os.listdir(d)} == {file_mode}
    with atomic_directory(str(d)) as tmp:  # replacing an existing folder too
        pass
    assert _mode(d) == dir_mode
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.txt", "run-state"]


def test_issue19_temporary_names_do_not_nest(tmp_path):
    """Issue 11 item 19: a writer handed an outer writer's temporary (save_weights inside save_network's
    atomic_path) wrapped it again: .x.tmp-…safetensors.tmp-….safetensors."""
    final = tmp_path / "cat.safetensors"
    seen = []
    with atomic_path(str(final)) as outer:
        seen.append(os.path.basename(outer))
        assert is_temporary_name(outer) and os.path.dirname(outer) == str(tmp_path)
        # what networks' save_weights does with the path it is given
        save_lora_state_dict(outer, {"a.alpha": torch.tensor(1.0)}, {"ss_network_dim": "1"})
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(outer)]  # written in place, no second temporary
    assert os.listdir(tmp_path) == ["cat.safetensors"]
    name = seen[0]
    assert name.startswith(".cat.safetensors.") and name.endswith(".tmp.safetensors")
    assert name.count(".tmp") == 1
    assert io_utils.final_name(name) == "cat.safetensors"


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_issue19_stale_temporaries_of_this_run_are_removed(tmp_path):
    """Issue 11 item 19: temporaries left by a kill during save stayed forever (incl. nested legacy names)."""
    dead = _dead_pid()
    stale = [
        f".cat.safetensors.{dead}-0123abcd.tmp.safetensors",            # a model file
        f".cat-step00000010-state.{dead}-89abcdef.tmp",                  # a state folder
        f".cat-state.old.{dead}-00000000.tmp",                           # a replaced state folder
        ".cat-000001.safetensors.tmp-a1b2c3d4.safetensors",              # the earlier naming
        ".cat.safetensors.tmp-abcd1234.safetensors.tmp-zz99yy88.safetensors",  # the earlier, nested
        ".cat-step00000020-state.x1y2z3w4.tmp",                          # the earlier folder naming
        ".cat-state.old.q1w2e3r4",
    ]
    keep = [
        "cat.safetensors", "cat-step00000010-state", ".hidden", "notes.tmp",
        f".catdog.safetensors.{dead}-0123abcd.tmp.safetensors",          # another run's name
        f".dog-state.{dead}-0123abcd.tmp",
        f".cat.safetensors.{os.getpid()}-0123abcd.tmp.safetensors",      # a live process is writing it
    ]
    for name in stale + keep:
        path = tmp_path / name
        if name.endswith("state") or "state." in name:
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"x")
        else:
            path.write_bytes(b"x")
    removed = clean_stale_temporaries(str(tmp_path), "cat")
    assert sorted(os.path.basename(p) for p in removed) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == sorted(keep)
    assert clean_stale_temporaries(str(tmp_path / "missing"), "cat") == []


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(str(tmp_path / "a.bin")) as tmp:
            open(tmp, "wb").write(b"1")
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        with atomic_directory(str(tmp_path / "d")) as tmp:
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
