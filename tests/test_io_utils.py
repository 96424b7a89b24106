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
def test_files_and_folders_respect_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    """Files and folders get the modes the umask leaves (not 0600 / 0700 whatever the umask)."""
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


def test_temporary_names_do_not_nest(tmp_path):
    """A writer handed an outer writer's temporary (save_weights inside save_network's
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


def test_stale_temporaries_of_this_run_are_removed(tmp_path):
    """Temporaries a kill during save left (nested legacy names included) are removed by the next run."""
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


# --- temporaries a SIGKILL leaves, and failed writes -----------------------------------------

def _partial_safetensors(path, metadata, cut=100):
    """The first bytes of a safetensors file with `metadata`, as a kill while writing its tensors leaves it."""
    from safetensors.torch import save

    data = save({"a.lora_up.weight": torch.ones(64, 64)}, metadata=metadata)
    path.write_bytes(data[: len(data) - cut])


def test_config_temporary_is_removed(tmp_path):
    """A SIGKILL while <name>_config.toml is written left .lora_config.toml.<pid>-<r>.tmp.toml forever
    (_belongs_to wanted `lora.` or `lora-`)."""
    dead = _dead_pid()
    stale = f".lora_config.toml.{dead}-0123abcd.tmp.toml"
    keep = [f".lora2_config.toml.{dead}-0123abcd.tmp.toml", f".lora_configs.toml.{dead}-0123abcd.tmp.toml",
            "lora_config.toml"]
    for name in [stale, *keep]:
        (tmp_path / name).write_text("x")
    removed = clean_stale_temporaries(str(tmp_path), "lora")
    assert [os.path.basename(p) for p in removed] == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted(keep)


def test_safetensors_own_temporaries_of_this_output_are_removed(tmp_path):
    """A SIGKILL inside safetensors' save_file left its .tmpXXXXXX (a whole model) in the output folder, which
    nothing removed. Those whose header names this output (LoRA: ss_output_name; fine-tune: the modelspec title
    "<name> (step N)") are removed; others, and ones too short to tell, stay."""
    _partial_safetensors(tmp_path / ".tmpAb12Cd", {"ss_output_name": "lora", "modelspec.title": "x"})
    _partial_safetensors(tmp_path / ".tmpZZ99yy", {"modelspec.title": "lora (step 10)"})
    _partial_safetensors(tmp_path / ".tmp000aaa", {"modelspec.title": "lora"})
    _partial_safetensors(tmp_path / ".tmpOther1", {"ss_output_name": "lora2"})
    _partial_safetensors(tmp_path / ".tmpNoMeta", None)
    (tmp_path / ".tmpEmpty0").write_bytes(b"")
    (tmp_path / ".tmpShort0").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    _partial_safetensors(tmp_path / ".tmpTooLongName", {"ss_output_name": "lora"})
    removed = clean_stale_temporaries(str(tmp_path), "lora")
    assert sorted(os.path.basename(p) for p in removed) == [".tmp000aaa", ".tmpAb12Cd", ".tmpZZ99yy"]
    assert sorted(os.listdir(tmp_path)) == [".tmpEmpty0", ".tmpNoMeta", ".tmpOther1", ".tmpShort0",
                                            ".tmpTooLongName"]


_KILLED_IN_SAVE_FILE = r"""
import os, signal, sys
import torch
import safetensors.torch
from library.core.io_utils import save_safetensors_atomic

def save_file(tensors, filename, metadata=None):  # as safetensors does it: its own temporary beside `filename`
    with open(os.path.join(os.path.dirname(filename), ".tmpKiLLed"), "wb") as f:
        f.write(b"\x00" * 4096)
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_file = save_file
save_safetensors_atomic({"x": torch.zeros(4)}, sys.argv[1], {"ss_output_name": "lora"})
"""


def test_a_kill_inside_save_file_leaves_only_our_temporary(tmp_path):
    """save_file's own temporary now lies inside our named temporary folder, which clean_stale_temporaries
    removes after the kill; before, it lay in the output folder under a name nothing recognised."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "lora-000001.safetensors").write_bytes(b"earlier")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _KILLED_IN_SAVE_FILE, str(out / "lora-000002.safetensors")],
                       cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, timeout=120)
    assert p.returncode == -9, p.stderr.decode()
    left = sorted(os.listdir(out))
    assert len(left) == 2 and left[1] == "lora-000001.safetensors"
    assert io_utils.final_name(left[0]) == "lora-000002.safetensors" and is_temporary_name(left[0])
    assert os.listdir(out / left[0]) == [".tmpKiLLed"]
    removed = clean_stale_temporaries(str(out), "lora")
    assert [os.path.basename(r) for r in removed] == [left[0]]
    assert os.listdir(out) == ["lora-000001.safetensors"]


def test_writer_failures_become_one_line_and_leave_nothing(tmp_path, monkeypatch):
    """safetensors reports a full disk as SafetensorError("... I/O error: No space left on device (os error 28)");
    atomic writers turn it (and OSError) into WriteFailed, one line naming the final path, temporary removed."""
    import safetensors.torch
    from safetensors import SafetensorError

    (tmp_path / "a.safetensors").write_bytes(b"earlier")

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"x" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(io_utils.WriteFailed) as e:
        save_safetensors_atomic({"x": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    assert str(e.value) == f"{tmp_path / 'a.safetensors'}: the disk is full; nothing was half-written"
    assert e.value.disk_full and isinstance(e.value, OSError)
    with pytest.raises(io_utils.WriteFailed) as e:  # through an outer atomic_path (networks' save_weights)
        with atomic_path(str(tmp_path / "b.safetensors")) as tmp:
            save_lora_state_dict(tmp, {"a.alpha": torch.tensor(1.0)}, {})
    assert str(e.value) == f"{tmp_path / 'b.safetensors'}: the disk is full; nothing was half-written"
    with pytest.raises(io_utils.WriteFailed) as e:
        with atomic_directory(str(tmp_path / "s-state")) as tmp:
            save_safetensors_atomic({"x": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))
    assert str(e.value) == f"{tmp_path / 's-state'}: the disk is full; nothing was half-written"

    def eio(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("builtins.open", eio)
    with pytest.raises(io_utils.WriteFailed) as e:
        io_utils.atomic_write_text(str(tmp_path / "lora_config.toml"), "x")
    monkeypatch.undo()
    assert str(e.value) == f"{tmp_path / 'lora_config.toml'}: could not be written (Input/output error); " \
                           "nothing was half-written"
    assert os.listdir(tmp_path) == ["a.safetensors"]
    assert (tmp_path / "a.safetensors").read_bytes() == b"earlier"


def test_other_exceptions_pass_through(tmp_path):
    """Only writers' failures become WriteFailed: a bug stays a bug (its traceback), a signal a signal."""
    for exc in (ValueError("bug"), RuntimeError("CUDA error: an illegal memory access"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with atomic_path(str(tmp_path / "a.bin")):
                raise exc
    assert os.listdir(tmp_path) == []
