"""Training state on disk: save it atomically, find the newest, and restore it exactly.

A state folder holds the files sd-scripts users know (model.safetensors with the
network weights, optimizer.bin, scheduler.bin, random_states_0.pkl,
train_state.json) plus what exact resumption needs: the number of batches
already consumed in the current epoch and the noise generator's state.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import pickle
import random
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from library.core.errors import UserError
from library.core.io_utils import atomic_directory

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
TRAIN_STATE = "train_state.json"


@dataclass
class TrainProgress:
    """Where a run stands. `epoch` is 1-based; `batches_done` counts micro-batches of that epoch."""

    epoch: int = 1
    global_step: int = 0
    batches_done: int = 0


def capture_rng(generators: dict[str, torch.Generator]) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {name: g.get_state() for name, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in generators.items():
        if name in state.get("generators", {}):
            g.set_state(state["generators"][name])


def save_state(state_dir: str, network_state: dict[str, torch.Tensor], optimizer, scheduler,
               progress: TrainProgress, generators: dict[str, torch.Generator], scaler=None) -> None:
    """Write the whole state into a temporary folder, then rename it into place."""
    with atomic_directory(state_dir) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in network_state.items()},
                  os.path.join(tmp, "model.safetensors"))
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.bin"))
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.bin"))
        with open(os.path.join(tmp, "random_states_0.pkl"), "wb") as f:
            pickle.dump(capture_rng(generators), f)
        if scaler is not None:
            torch.save(scaler.state_dict(), os.path.join(tmp, "scaler.pt"))
        with open(os.path.join(tmp, TRAIN_STATE), "w", encoding="utf-8") as f:
            json.dump({"current_epoch": progress.epoch, "current_step": progress.global_step,
                       "batches_done": progress.batches_done, "format": STATE_FORMAT}, f)


def read_progress(state_dir: str) -> TrainProgress:
    path = os.path.join(state_dir, TRAIN_STATE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return TrainProgress(epoch=int(data["current_epoch"]), global_step=int(data["current_step"]),
                             batches_done=int(data.get("batches_done", 0)))
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--resume {state_dir}: not a training state folder ({TRAIN_STATE}: {e})") from None


def find_latest_state(output_dir: str) -> Optional[str]:
    """The complete state folder in output_dir with the highest step (temporary folders are ignored)."""
    best, best_step = None, -1
    for path in glob.glob(os.path.join(output_dir, "*-state")):
        if not os.path.isfile(os.path.join(path, TRAIN_STATE)):
            continue
        try:
            step = read_progress(path).global_step
        except UserError:
            continue
        if step > best_step:
            best, best_step = path, step
    return best


def load_state(state_dir: str, network, optimizer, scheduler, generators: dict[str, torch.Generator],
               scaler=None) -> TrainProgress:
    """Restore network weights, optimizer, scheduler and RNG states; return the progress counters."""
    progress = read_progress(state_dir)
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        if not os.path.isfile(os.path.join(state_dir, name)):
            raise UserError(f"--resume {state_dir}: {name} is missing; the state is incomplete")
    weights = load_file(os.path.join(state_dir, "model.safetensors"))
    missing, unexpected = network.load_state_dict(weights, strict=False)
    if unexpected or missing:
        raise UserError(f"--resume {state_dir}: network weights do not match this network "
                        f"({len(missing)} missing, {len(unexpected)} unexpected keys, e.g. {(missing + unexpected)[0]})")
    optimizer.load_state_dict(torch.load(os.path.join(state_dir, "optimizer.bin"), weights_only=False))
    scheduler.load_state_dict(torch.load(os.path.join(state_dir, "scheduler.bin"), weights_only=False))
    with open(os.path.join(state_dir, "random_states_0.pkl"), "rb") as f:
        restore_rng(pickle.load(f), generators)
    scaler_path = os.path.join(state_dir, "scaler.pt")
    if scaler is not None and os.path.isfile(scaler_path):
        scaler.load_state_dict(torch.load(scaler_path, weights_only=False))
    return progress


def progress_dict(progress: TrainProgress) -> dict:
    return asdict(progress)


def resume_progress(where: Optional[str], output_dir: str, max_train_steps: int, network, optimizer, scheduler,
                    generators: dict[str, torch.Generator], scaler=None) -> TrainProgress:
    """--resume: load the state folder (or, for "auto", the newest one in output_dir) and return where it stood.

    A fresh TrainProgress when nothing is to be resumed; UserError for a missing folder or a finished run.
    """
    if not where:
        return TrainProgress()
    if where == "auto":
        where = find_latest_state(output_dir)
        if where is None:
            logger.info("--resume auto: no saved state in %s; starting fresh", output_dir)
            return TrainProgress()
    if not os.path.isdir(where):
        raise UserError(f"--resume {where}: folder not found")
    progress = load_state(where, network, optimizer, scheduler, generators, scaler)
    if progress.global_step >= max_train_steps:
        raise UserError(f"--resume {where}: that run already finished ({progress.global_step} of "
                        f"{max_train_steps} steps); raise --max_train_steps/--max_train_epochs to go on")
    logger.info("resumed from %s at epoch %d, step %d", where, progress.epoch, progress.global_step)
    return progress
