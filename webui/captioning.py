"""Captioning from the page: the toolkit's own captioners and taggers (finetune/) run as subprocesses on a folder
the server may read, writing `<image stem><extension>` beside each image (what the trainer reads as captions).

| captioner | script | model setting (a local path: nothing is downloaded) | default extension |
|---|---|---|---|
| wd14 | finetune/tag_images_by_wd14_tagger.py | `--model_dir` (holds `<repo_id with / as _>/model.onnx`) | .txt |
| blip | finetune/make_captions.py | `--caption_weights` (a transformers BLIP folder) | .caption |
| git | finetune/make_captions_by_git.py | `--model_id` (a transformers GIT folder) | .caption |

Images that already have a caption file are left alone unless `overwrite` is asked for, so a stopped run resumes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Captioner:
    script: str
    model_flag: str
    extension: str
    label: str


CAPTIONERS = {
    "wd14": Captioner(os.path.join("finetune", "tag_images_by_wd14_tagger.py"), "--model_dir", ".txt",
                      "WD14 tagger (tags)"),
    "blip": Captioner(os.path.join("finetune", "make_captions.py"), "--caption_weights", ".caption",
                      "BLIP (sentences)"),
    "git": Captioner(os.path.join("finetune", "make_captions_by_git.py"), "--model_id", ".caption",
                     "GIT (sentences)"),
}


def caption_command(captioner: str, folder: str, model: str, extension: Optional[str], recursive: bool,
                    overwrite: bool, threshold: Optional[float], batch_size: Optional[int]) -> list[str]:
    """The captioner's command line (an argument list, no shell)."""
    spec = CAPTIONERS[captioner]
    argv = [sys.executable, spec.script, folder, spec.model_flag, model,
            "--caption_extension", extension or spec.extension]
    if recursive:
        argv.append("--recursive")
    if captioner == "git":
        if overwrite:
            argv.append("--overwrite")  # GIT skips captioned images by default
    elif not overwrite:
        argv.append("--skip_existing")
    if threshold is not None and captioner == "wd14":
        argv += ["--thresh", str(threshold)]
    if batch_size is not None:
        argv += ["--batch_size", str(batch_size)]
    return argv


def count_captions(folder: str, extension: str, recursive: bool) -> int:
    """Caption files with `extension` in `folder` (and its subfolders with `recursive`)."""
    total = 0
    for _here, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")] if recursive else []
        total += sum(1 for f in files if f.endswith(extension))
    return total
