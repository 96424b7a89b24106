"""When to save, what the files are called (sd-scripts names), and which old ones to remove."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Optional


def epoch_stem(name: str, epoch: int) -> str:
    return f"{name}-{epoch:06d}"


def step_stem(name: str, step: int) -> str:
    return f"{name}-step{step:08d}"


FOLDER_FORMATS = ("diffusers", "diffusers_safetensors")


def model_path(output_dir: str, stem: str, save_model_as: str) -> str:
    """`<stem>.<ext>` for file formats; a folder `<stem>` for the diffusers formats."""
    if save_model_as in FOLDER_FORMATS:
        return os.path.join(output_dir, stem)
    return os.path.join(output_dir, f"{stem}.{save_model_as}")


def state_path(output_dir: str, stem: str) -> str:
    return os.path.join(output_dir, f"{stem}-state")


@dataclass
class SavePlan:
    """Save cadence and retention, as the --save_* flags give them."""
    every_n_epochs: Optional[int] = None
    every_n_steps: Optional[int] = None
    last_n_epochs: Optional[int] = None
    last_n_epochs_state: Optional[int] = None
    last_n_steps: Optional[int] = None
    last_n_steps_state: Optional[int] = None

    def save_at_epoch(self, epoch: int, num_epochs: int) -> bool:
        # The last epoch gets only the final file, as in sd-scripts.
        return bool(self.every_n_epochs) and epoch % self.every_n_epochs == 0 and epoch < num_epochs

    def save_at_step(self, step: int, max_steps: int) -> bool:
        return bool(self.every_n_steps) and step % self.every_n_steps == 0 and step < max_steps

    def epoch_to_remove(self, epoch: int, for_state: bool) -> Optional[int]:
        keep = (self.last_n_epochs_state or self.last_n_epochs) if for_state else self.last_n_epochs
        if not keep or not self.every_n_epochs:
            return None
        old = epoch - self.every_n_epochs * keep
        return old if old > 0 else None

    def step_to_remove(self, step: int, for_state: bool) -> Optional[int]:
        window = (self.last_n_steps_state or self.last_n_steps) if for_state else self.last_n_steps
        if not window or not self.every_n_steps:
            return None
        # Remove the save that just left the window [step - window, step].
        old = (step - window - 1) // self.every_n_steps * self.every_n_steps
        return old if old > 0 and old < step - window else None


def remove_path(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
