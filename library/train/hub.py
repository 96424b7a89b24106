"""Uploads to (and a state download from) the Hugging Face Hub: sd-scripts' --huggingface_* flags
(library/huggingface_util.py there), through `huggingface_hub`.

What is uploaded, as sd-scripts: every saved model file (or diffusers folder) when --huggingface_repo_id is given,
and every saved state folder with --save_state_to_huggingface, to `<--huggingface_path_in_repo>/<name>` (the file's
or folder's own name at the top of the repository without it). The repository is created when it does not exist
(private unless --huggingface_repo_visibility public). With --async_upload each upload runs on a background thread,
except the final model's, which the run waits for (and waits for the earlier ones before it ends).

An upload never stops or corrupts training: any failure (network, authentication, a refused commit) is one
warning naming the file, and the local file stays where it was written. $HF_ENDPOINT (read at each call) points
at another Hub server; the tests use a stand-in on 127.0.0.1.
"""

from __future__ import annotations

import logging
import os
import posixpath
import tempfile
import threading
from dataclasses import dataclass
from typing import Optional

from library.core.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubOptions:
    repo_id: Optional[str] = None
    repo_type: Optional[str] = None  # model (default), dataset or space
    path_in_repo: Optional[str] = None
    token: Optional[str] = None
    repo_visibility: Optional[str] = None  # "public"; anything else is private, as sd-scripts
    save_state_to_huggingface: bool = False
    resume_from_huggingface: bool = False
    async_upload: bool = False


def _api(token: Optional[str]):
    from huggingface_hub import HfApi  # optional at import time: only runs that name a repository need it

    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)


class HubUploader:
    """Uploads what a run saves; `wait()` before the process ends."""

    def __init__(self, opts: HubOptions):
        self.opts = opts
        self._threads: list[threading.Thread] = []
        self._repo_checked = False
        self.failures: list[str] = []

    def model_saved(self, path: str, final: bool = False) -> None:
        self._upload(path, wait=final)

    def state_saved(self, state_dir: str, final: bool = False) -> None:
        if self.opts.save_state_to_huggingface:
            self._upload(state_dir, wait=final)

    def wait(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _upload(self, path: str, wait: bool) -> None:
        if self.opts.async_upload and not wait:
            thread = threading.Thread(target=self._upload_now, args=(path,), daemon=True, name="hub-upload")
            self._threads.append(thread)
            thread.start()
        else:
            self.wait()  # in order: the final upload comes after the earlier ones
            self._upload_now(path)

    def _upload_now(self, path: str) -> None:
        o = self.opts
        name = os.path.basename(os.path.normpath(path))
        dest = posixpath.join(o.path_in_repo.strip("/"), name) if o.path_in_repo else name
        try:
            api = _api(o.token)
            if not self._repo_checked:
                api.create_repo(o.repo_id, repo_type=o.repo_type, private=o.repo_visibility != "public",
                                exist_ok=True)
                self._repo_checked = True
            if os.path.isdir(path):
                api.upload_folder(repo_id=o.repo_id, repo_type=o.repo_type, folder_path=path, path_in_repo=dest,
                                  commit_message=f"upload {name}")
            else:
                api.upload_file(repo_id=o.repo_id, repo_type=o.repo_type, path_or_fileobj=path, path_in_repo=dest,
                                commit_message=f"upload {name}")
            logger.info("uploaded %s to %s:%s", path, o.repo_id, dest)
        except Exception as e:  # noqa: BLE001 - any failure of an upload must leave training running
            self.failures.append(path)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            logger.warning("upload of %s to the Hugging Face Hub (%s) failed, the local file is kept: %s", path,
                           o.repo_id, first)


def parse_hub_state(spec: str) -> tuple[str, str, Optional[str], str]:
    """--resume <owner>/<repo>/<path>[:<revision>[:<repo_type>]] (sd-scripts' form) ->
    (repo_id, path_in_repo, revision, repo_type)."""
    parts = spec.split("/")
    if len(parts) < 3 or not all(parts[:2]):
        raise ValueError(f"expected <owner>/<repo>/<path in repo>[:<revision>[:<repo type>]], got {spec!r}")
    repo_id, rest = "/".join(parts[:2]), "/".join(parts[2:])
    revision, repo_type = None, "model"
    if ":" in rest:
        divided = rest.split(":")
        rest, revision = divided[0], divided[1] or None
        if len(divided) > 2:
            repo_type = divided[2] or "model"
    return repo_id, rest.strip("/"), revision, repo_type


def download_state(spec: str, token: Optional[str], into: Optional[str] = None) -> str:
    """The state folder named by --resume with --resume_from_huggingface, downloaded; returns the local folder."""
    from huggingface_hub import snapshot_download

    repo_id, path, revision, repo_type = parse_hub_state(spec)
    into = into or tempfile.mkdtemp(prefix="hub-state-")
    try:
        snapshot_download(repo_id, repo_type=repo_type, revision=revision, token=token, local_dir=into,
                          allow_patterns=[f"{path}/*"], endpoint=os.environ.get("HF_ENDPOINT") or None)
    except Exception as e:  # noqa: BLE001 - any Hub or network failure is one line before training
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--resume {spec} --resume_from_huggingface: download failed: {first}") from None
    local = os.path.join(into, *path.split("/"))
    if not os.path.isdir(local) or not os.listdir(local):
        raise UserError(f"--resume {spec} --resume_from_huggingface: no files under {path} in {repo_id}")
    logger.info("downloaded state %s to %s", spec, local)
    return local
