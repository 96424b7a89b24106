"""sd-scripts' Hugging Face Hub flags (--huggingface_*, --save_state_to_huggingface, --resume_from_huggingface,
--async_upload) -> HubOptions (library/train/hub.py does the uploads)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar, Optional

from library.cli.options import flag, settings_from
from library.core.errors import ConfigError
from library.train.hub import HubOptions, parse_hub_state


@dataclass
class HubFlags:
    flag_group: ClassVar[str] = "Hugging Face Hub (docs/hub.md)"
    huggingface_repo_id: Optional[str] = flag(None, "upload every saved model to this Hub repository (owner/name); a "
                                                    "failed upload warns and keeps the local file")
    huggingface_repo_type: Optional[str] = flag(None, "repository type (default model)",
                                                      choices=("model", "dataset", "space"))
    huggingface_path_in_repo: Optional[str] = flag(None, "folder inside the repository (default: its top)")
    huggingface_token: Optional[str] = flag(None, "Hub token (else HF_TOKEN or `hf auth login`); never written to "
                                                  "the saved config")
    huggingface_repo_visibility: Optional[str] = flag(None, "visibility of a repository the run creates (default "
                                                            "private)", choices=("public", "private"))
    save_state_to_huggingface: bool = flag(False, "also upload every saved state folder")
    resume_from_huggingface: bool = flag(False, "--resume names a state on the Hub: "
                                                "<owner>/<repo>/<path>[:<revision>[:<repo type>]]")
    async_upload: bool = flag(False, "upload in the background while training goes on (the final model is waited "
                                     "for)")


def hub_options_from_args(ns: argparse.Namespace) -> HubOptions:
    """HubOptions (the switches are taken as they are), checked across flags."""
    opts = settings_from(HubOptions, ns, repo_id=ns.huggingface_repo_id, repo_type=ns.huggingface_repo_type,
                         path_in_repo=ns.huggingface_path_in_repo, token=ns.huggingface_token,
                         repo_visibility=ns.huggingface_repo_visibility)
    if not opts.repo_id:
        for name in ("huggingface_repo_type", "huggingface_path_in_repo", "huggingface_repo_visibility",
                     "save_state_to_huggingface", "async_upload"):
            if getattr(ns, name):
                raise ConfigError(f"--{name}: only used with --huggingface_repo_id")
    elif opts.repo_id.count("/") != 1 or not all(opts.repo_id.split("/")):
        raise ConfigError(f"--huggingface_repo_id {opts.repo_id}: expected <owner>/<name>")
    if opts.save_state_to_huggingface and not (ns.save_state or ns.save_state_on_train_end):
        raise ConfigError("--save_state_to_huggingface: no state is saved; add --save_state or "
                          "--save_state_on_train_end")
    if opts.resume_from_huggingface:
        if not ns.resume:
            raise ConfigError("--resume_from_huggingface: needs --resume <owner>/<repo>/<path>[:<revision>[:<type>]]")
        try:
            parse_hub_state(ns.resume)
        except ValueError as e:
            raise ConfigError(f"--resume {ns.resume}: {e}") from None
    return opts

