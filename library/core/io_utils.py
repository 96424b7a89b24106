"""Atomic writes: nothing the toolkit writes is ever half-written.

Temporaries live beside their final path and are named once, `.<final name>.<pid>-<random>.tmp<ext>`
(the extension is kept because some writers - np.savez, save_weights - choose the format by it). A
writer handed a path that is already one of these temporaries writes it directly instead of wrapping
it again, so names never nest. `.safetensors` files are written inside a temporary folder of that
scheme (`.<final name>.<pid>-<random>.tmp/`), because safetensors' `save_file` writes through its own
`.tmpXXXXXX` beside the path it is given: that one then lies inside ours. `clean_stale_temporaries`
removes the ones a killed run left behind (and the `.tmpXXXXXX` files earlier versions left in the
output folder, when their header names the run's output).

A write that fails (the disk full, a quota, an I/O error; however the writer reports it: OSError,
safetensors' SafetensorError, torch.save's RuntimeError) removes its temporary and raises
`WriteFailed`, a one-line UserError (and an OSError) naming the final path.

Files and folders are created with the modes `open()` / `os.mkdir()` use (0666 / 0777 less the
umask), so a LoRA written under the usual umask 022 is 0644 and its folders 0755.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
from typing import Iterator, Optional

from library.core.errors import UserError

logger = logging.getLogger(__name__)

# .<name>.<pid>-<8 hex>.tmp[<ext>]
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]{8}\.tmp(?P<ext>\.[^.]*)?$")
# The names earlier versions used: .<name>.tmp-<mkstemp token><ext> (files), .<name>.<token>.tmp and
# .<name>.old.<token> (folders).
_LEGACY_RES = (
    re.compile(r"^\.(?P<name>.+)\.tmp-[A-Za-z0-9_]{8}(?P<ext>\.[^.]*)?$"),
    re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$"),
    re.compile(r"^\.(?P<name>.+)\.old\.[A-Za-z0-9_]{8}$"),
)
_OLD_SUFFIX = ".old"
# safetensors' own temporary (Rust's tempfile crate: ".tmp" and 6 random letters or digits).
_SAFETENSORS_TEMP_RE = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
# How a full disk reads in the writers' messages (safetensors: "I/O error: No space left on device (os error 28)").
_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "os error 28)", "os error 122)")
# torch.save's writer reports a failed write without its cause ("[enforce fail at inline_container.cc:...]
# unexpected pos ...", "PytorchStreamWriter failed writing file ...").
_TORCH_WRITER_TEXTS = ("inline_container", "pytorchstreamwriter", "file write failed")
MiB = 2**20


class WriteFailed(UserError, OSError):
    """Writing `path` failed (`disk_full`: no space or quota left; otherwise `reason`); the temporary is removed
    and whatever was at `path` before is unchanged. An OSError too, so `except OSError` callers keep working."""

    def __init__(self, path: str, disk_full: bool, reason: str):
        OSError.__init__(self, errno.ENOSPC if disk_full else errno.EIO, reason, path)
        self.path, self.disk_full, self.reason = path, disk_full, reason
        what = "the disk is full" if disk_full else f"could not be written ({reason})"
        self.message = f"{path}: {what}; nothing was half-written"

    def __str__(self) -> str:
        return self.message


def _free_bytes(folder: str) -> Optional[int]:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def write_failure(exc: BaseException, folder: str) -> Optional[tuple[bool, str]]:
    """(disk full?, reason) when `exc` is a writer's failure to write into `folder`; None for anything else
    (a bug, a signal). Call it before the partial file is removed: torch.save does not say why a write
    failed, so a folder with under 1 MiB free then counts as full."""
    if isinstance(exc, WriteFailed):
        return exc.disk_full, exc.reason
    text = str(exc)
    full_text = any(t in text.lower() for t in _FULL_TEXTS)
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT) or full_text, exc.strerror or text or type(exc).__name__
    if type(exc).__name__ == "SafetensorError" and "I/O error" in text:
        return full_text, text
    if isinstance(exc, RuntimeError) and any(t in text.lower() for t in _TORCH_WRITER_TEXTS):
        free = _free_bytes(folder)
        return full_text or (free is not None and free < MiB), text.strip().splitlines()[0] if text.strip() else "?"
    return None


def _temp_match(basename: str):
    m = _TEMP_RE.match(basename)
    if m:
        return m
    for rx in _LEGACY_RES:
        m = rx.match(basename)
        if m:
            return m
    return None


def is_temporary_name(path: str) -> bool:
    """True for a name this module gives its temporaries (current or earlier scheme)."""
    return _temp_match(os.path.basename(os.path.normpath(path))) is not None


def final_name(path: str) -> str:
    """The final name a temporary stands for, unwrapping every level; a final name is returned as is."""
    base = os.path.basename(os.path.normpath(path))
    m = _temp_match(base)
    while m is not None:
        base = m.group("name")
        if base.endswith(_OLD_SUFFIX):  # the folder an atomic_directory moves the previous version into
            base = base[: -len(_OLD_SUFFIX)]
        m = _temp_match(base)
    return base


def _temp_path(final_path: str, ext: str = "", old: bool = False) -> str:
    directory = os.path.dirname(os.path.abspath(final_path))
    base = final_name(final_path) + (_OLD_SUFFIX if old else "")
    return os.path.join(directory, f".{base}.{os.getpid()}-{secrets.token_hex(4)}.tmp{ext}")


def _create_file(final_path: str) -> str:
    """A new empty temporary file beside `final_path`, mode 0666 less the umask."""
    ext = os.path.splitext(final_name(final_path))[1]
    for _ in range(100):
        tmp = _temp_path(final_path, ext)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(errno.EEXIST, "could not create a temporary file", final_path)


def _create_dir(final_path: str, old: bool = False) -> str:
    """A new empty temporary folder beside `final_path`, mode 0777 less the umask."""
    for _ in range(100):
        tmp = _temp_path(final_path, old=old)
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(errno.EEXIST, "could not create a temporary folder", final_path)


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask is set-and-return)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _set_file_mode(path: str) -> None:
    """0666 less the umask, as open() gives: some writers (safetensors >= 0.5) create their files 0600."""
    with contextlib.suppress(OSError):
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, 0o666 & ~current_umask())


@contextlib.contextmanager
def atomic_path(final_path: str) -> Iterator[str]:
    """Yield a temporary path beside `final_path`; rename onto it only if the block succeeds.

    When `final_path` is itself a temporary of this module (an outer writer's), it is yielded as is:
    the outer writer renames it, and temporary names never nest.
    """
    if is_temporary_name(final_path):
        yield final_path
        return
    directory = os.path.dirname(os.path.abspath(final_path)) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = _create_file(final_path)
    try:
        yield tmp
        _set_file_mode(tmp)
        os.replace(tmp, final_path)
    except BaseException as e:
        failure = write_failure(e, directory)  # before the partial file is removed (see write_failure)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if failure is None:
            raise
        raise WriteFailed(final_path, *failure) from e


@contextlib.contextmanager
def atomic_directory(final_dir: str) -> Iterator[str]:
    """Yield a temporary folder beside `final_dir`; when the block succeeds it replaces `final_dir`.

    Temporary names start with "." so globs for finished folders never see them.
    """
    final_dir = os.path.abspath(final_dir)
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = _create_dir(final_dir)
    try:
        yield tmp
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                _set_file_mode(os.path.join(root, name))
        if os.path.exists(final_dir):
            old = _create_dir(final_dir, old=True)
            os.replace(final_dir, os.path.join(old, "previous"))
            os.replace(tmp, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final_dir)
    except BaseException as e:
        failure = write_failure(e, parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if failure is None:
            raise
        raise WriteFailed(final_dir, *failure) from e


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _belongs_to(name: str, output_name: str) -> bool:
    """`name` (a final name) is `output_name` or one of its derived names (`<name>-000001.safetensors`,
    `<name>-step00000010-state`, `<name>.safetensors`, `<name>_config.toml`, ...)."""
    return (name == output_name or name.startswith(output_name + ".") or name.startswith(output_name + "-")
            or name == output_name + "_config.toml")


def _safetensors_output_name(path: str) -> Optional[str]:
    """The output name a partial `.safetensors` file's header records (LoRA: ss_output_name, else the
    modelspec title, "<name>" or "<name> (step N)"); None when the header is missing, cut short or names none."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            n = int.from_bytes(head, "little")
            if not 2 <= n <= 100 * MiB:
                return None
            raw = f.read(n)
        meta = json.loads(raw).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(meta, dict):
        return None
    if isinstance(meta.get("ss_output_name"), str):
        return meta["ss_output_name"]
    title = meta.get("modelspec.title")
    if isinstance(title, str):
        return re.sub(r" \(step \d+\)$", "", title)
    return None


def clean_stale_temporaries(directory: str, output_name: str) -> list[str]:
    """Remove the temporaries a killed run left in `directory` for `output_name`'s files and states.

    Only names this module creates are touched, only those whose final name is `output_name` or derived
    from it, and not those of a process still alive (a run writing there now). Returns the removed paths.
    """
    removed: list[str] = []
    if not output_name or not os.path.isdir(directory):
        return removed
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if _SAFETENSORS_TEMP_RE.match(entry):  # safetensors' own, left in the output folder by earlier versions
            if os.path.isfile(path) and not os.path.islink(path) and _safetensors_output_name(path) == output_name:
                try:
                    os.remove(path)
                    removed.append(path)
                except OSError as e:
                    logger.warning("could not remove the stale temporary %s: %s", path, e)
            continue
        m = _temp_match(entry)
        if m is None or not _belongs_to(final_name(entry), output_name):
            continue
        pid = m.groupdict().get("pid")
        if pid is not None and _pid_alive(int(pid)):
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError as e:
            logger.warning("could not remove the stale temporary %s: %s", path, e)
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d stale temporar%s of an earlier run in %s: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", directory, ", ".join(os.path.basename(p) for p in removed))
    return removed


def clean_stale_temporaries_of(path: str) -> list[str]:
    """clean_stale_temporaries for one output file or folder a tool is about to write."""
    path = os.path.abspath(path)
    return clean_stale_temporaries(os.path.dirname(path), os.path.basename(path))


def atomic_write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


@contextlib.contextmanager
def atomic_path_in_folder(final_path: str) -> Iterator[str]:
    """Like atomic_path, for writers that make their own temporary beside the path they are given
    (safetensors' save_file: `.tmpXXXXXX`, then a rename): yield `<temporary folder>/<final name>`, so
    that their temporary lies inside ours (removed with it, and by clean_stale_temporaries after a kill);
    on success the file is renamed onto `final_path` and the folder removed."""
    directory = os.path.dirname(os.path.abspath(final_path)) or "."
    os.makedirs(directory, exist_ok=True)
    folder = _create_dir(final_path)
    try:
        inner = os.path.join(folder, final_name(final_path))
        yield inner
        _set_file_mode(inner)
        os.replace(inner, final_path)
        os.rmdir(folder)
    except BaseException as e:
        failure = write_failure(e, directory)
        shutil.rmtree(folder, ignore_errors=True)
        if failure is None:
            raise
        raise WriteFailed(final_path, *failure) from e


def save_safetensors_atomic(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """safetensors' save_file, atomically and through our own temporary (see atomic_path_in_folder); no copy of
    the tensors is made (save_file writes them from their memory)."""
    from safetensors.torch import save_file

    with atomic_path_in_folder(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
