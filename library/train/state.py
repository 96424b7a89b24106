"""Training state on disk: one `RunState` per run, saved atomically, validated and restored exactly.

A state folder holds the files sd-scripts users know (model.safetensors with the
trained weights, optimizer.bin, scheduler.bin, random_states_0.pkl,
train_state.json) plus what exact resumption needs: the micro-batches already
consumed in the current epoch, the noise generator, the EMA weights when
--use_ema is on, and the flags that fix tensor shapes (checked on resume), and every flag of the run (a resume names
those that changed).
With N data-parallel processes, random_states_<rank>.pkl holds each process's
RNGs (accelerate's names) and train_state.json records N: a state resumes only
with the same number of processes.

A state is read completely (every file parsed) before any of it is applied, so a
damaged one is named and, with `--resume auto`, skipped for the newest intact one.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import pickle
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file

from library.core.errors import UserError
from library.core.io_utils import atomic_directory

logger = logging.getLogger(__name__)

STATE_FORMAT = 2
TRAIN_STATE = "train_state.json"
WEIGHTS, OPTIMIZER, SCHEDULER, RNG, SCALER, EMA = (
    "model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "scaler.pt", "ema.safetensors")
REQUIRED_FILES = (TRAIN_STATE, WEIGHTS, OPTIMIZER, SCHEDULER, RNG)


@dataclass
class TrainProgress:
    """Where a run stands. `epoch` is 1-based; `batches_done` counts micro-batches of that epoch."""

    epoch: int = 1
    global_step: int = 0
    batches_done: int = 0


class DamagedState(UserError):
    """A state folder that cannot be resumed from (a file missing, truncated or unreadable)."""


@dataclass
class RunState:
    """Where a run stands and every source of randomness it draws from: what makes a resume exact.

    Created once per run by `RunState.start(seed)`; the loop advances `progress` after every
    optimizer step, and `save_state` / `resume_state` write and restore it whole.
    """

    progress: TrainProgress
    noise_generator: torch.Generator
    flags: dict[str, Any] = field(default_factory=dict)  # every flag of this run (RunSettings.flags)

    @classmethod
    def start(cls, seed: int, rank: int = 0, flags: Optional[dict[str, Any]] = None) -> "RunState":
        """Process `rank` of a data-parallel run draws its noise from its own stream (rank 0: the seed itself, so
        one process trains as before); the global RNGs are seeded alike on every process (equal initial weights)."""
        set_seed(seed)  # Python, NumPy, torch and every accelerator's RNG
        noise_seed = seed if rank == 0 else (seed + 0x9E3779B97F4A7C15 * rank) % (1 << 63)
        return cls(TrainProgress(), torch.Generator("cpu").manual_seed(noise_seed), as_json(flags or {}))

    def advance(self, epoch: int, global_step: int, batches_done: int) -> None:
        self.progress = TrainProgress(epoch, global_step, batches_done)

    def capture_rng(self) -> dict:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                 "generators": {"noise": self.noise_generator.get_state()}}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def restore_rng(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        if "noise" in state.get("generators", {}):
            self.noise_generator.set_state(state["generators"]["noise"])


@dataclass
class SavedState:
    """A state folder read into memory and checked; nothing applied yet."""

    path: str
    progress: TrainProgress
    weights: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: dict  # this process's RNGs (random_states_<rank>.pkl)
    scaler: Optional[dict] = None
    ema: Optional[dict[str, torch.Tensor]] = None
    shape_settings: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1  # processes of the run that saved it
    flags: dict[str, Any] = field(default_factory=dict)  # the flags of the run that saved it ({}: an older state)


def rng_file(rank: int) -> str:
    return f"random_states_{rank}.pkl"


def save_state(state_dir: str, weights: dict[str, torch.Tensor], optimizer_state: dict, scheduler, run: RunState,
               progress: TrainProgress, scaler=None, ema: Optional[dict[str, torch.Tensor]] = None,
               shape_settings: Optional[dict[str, Any]] = None, rng_states: Optional[list[dict]] = None) -> None:
    """Write the whole state into a temporary folder, then rename it into place.

    `rng_states`: every process's RNGs, by rank (data parallel; gathered by the caller); default: this one's."""
    rng_states = rng_states or [run.capture_rng()]
    with atomic_directory(state_dir) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, os.path.join(tmp, WEIGHTS))
        torch.save(optimizer_state, os.path.join(tmp, OPTIMIZER))
        torch.save(scheduler.state_dict(), os.path.join(tmp, SCHEDULER))
        for rank, rng in enumerate(rng_states):
            with open(os.path.join(tmp, rng_file(rank)), "wb") as f:
                pickle.dump(rng, f)
        if scaler is not None:
            torch.save(scaler.state_dict(), os.path.join(tmp, SCALER))
        if ema is not None:
            save_file({k: v.detach().contiguous().cpu() for k, v in ema.items()}, os.path.join(tmp, EMA))
        with open(os.path.join(tmp, TRAIN_STATE), "w", encoding="utf-8") as f:
            json.dump({"current_epoch": progress.epoch, "current_step": progress.global_step,
                       "batches_done": progress.batches_done, "format": STATE_FORMAT,
                       "shape_settings": shape_settings or {}, "world_size": len(rng_states), "flags": run.flags},
                      f, default=str)


def read_progress(state_dir: str) -> TrainProgress:
    return _read_train_state(state_dir)[0]


def _read_train_state(state_dir: str) -> tuple[TrainProgress, dict, dict]:
    path = os.path.join(state_dir, TRAIN_STATE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        progress = TrainProgress(epoch=int(data["current_epoch"]), global_step=int(data["current_step"]),
                                 batches_done=int(data.get("batches_done", 0)))
        return progress, dict(data.get("shape_settings") or {}), dict(data.get("flags") or {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedState(f"{state_dir}: not a training state folder ({TRAIN_STATE}: {e})") from None


def read_world_size(state_dir: str) -> int:
    """The number of processes of the run that saved the state (1 for states written before it was recorded)."""
    try:
        with open(os.path.join(state_dir, TRAIN_STATE), encoding="utf-8") as f:
            return int(json.load(f).get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def read_state(state_dir: str, rank: int = 0) -> SavedState:
    """Read and parse every file of a state folder (the RNGs of process `rank`); DamagedState names the first one
    that fails."""
    progress, shape_settings, flags = _read_train_state(state_dir)
    world_size = read_world_size(state_dir)
    for name in REQUIRED_FILES + ((rng_file(rank),) if rank < world_size else ()):
        if not os.path.isfile(os.path.join(state_dir, name)):
            raise DamagedState(f"{state_dir}: {name} is missing; the state is incomplete")

    def read(name: str, how):
        try:
            return how(os.path.join(state_dir, name))
        except Exception as e:  # truncated or garbled: every reader raises its own type
            raise DamagedState(f"{state_dir}: {name} is damaged ({type(e).__name__}: {str(e)[:120]})") from None

    def unpickle(path: str):
        with open(path, "rb") as f:
            return pickle.load(f)

    def torch_load(path: str):
        return torch.load(path, weights_only=False, map_location="cpu")

    return SavedState(
        path=state_dir, progress=progress, weights=read(WEIGHTS, load_file), optimizer=read(OPTIMIZER, torch_load),
        scheduler=read(SCHEDULER, torch_load), rng=read(rng_file(rank if rank < world_size else 0), unpickle),
        scaler=read(SCALER, torch_load) if os.path.isfile(os.path.join(state_dir, SCALER)) else None,
        ema=read(EMA, load_file) if os.path.isfile(os.path.join(state_dir, EMA)) else None,
        shape_settings=shape_settings, world_size=world_size, flags=flags)


def state_folders(output_dir: str) -> list[str]:
    """Finished state folders in output_dir, newest (highest step) first; temporary folders are ignored."""
    found = []
    for path in glob.glob(os.path.join(output_dir, "*-state")):
        try:
            found.append((read_progress(path).global_step, path))
        except DamagedState:
            found.append((-1, path))
    return [path for _, path in sorted(found, key=lambda item: (-item[0], item[1]))]


def check_world_size(saved: SavedState, world_size: int, where: str) -> None:
    """Refuse a state saved by another number of processes: the batch plan and RNG streams are per process."""
    if saved.world_size != world_size:
        raise UserError(f"--resume {where}: the state was saved by a run of {saved.world_size} process(es), this "
                        f"run has {world_size}; resume with --num_processes {saved.world_size} (each process's "
                        "batches and random streams are in the state), or start a new run")


def check_shapes(saved: SavedState, weights: dict[str, torch.Tensor], shape_settings: dict[str, Any],
                 where: str) -> None:
    """Refuse a state whose tensors or shape-fixing flags differ from this run's, naming the difference."""
    changed = [f"{name} {saved.shape_settings[name]!r} -> {value!r}" for name, value in shape_settings.items()
               if name in saved.shape_settings and saved.shape_settings[name] != value]
    if changed:
        raise UserError(f"--resume {where}: the state was saved with other shape flags ({'; '.join(changed)}); "
                        "resume with the flags it was trained with, or start a new run")
    missing = sorted(set(weights) - set(saved.weights))
    unexpected = sorted(set(saved.weights) - set(weights))
    if missing or unexpected:
        example = (missing + unexpected)[0]
        raise UserError(f"--resume {where}: the saved weights do not match this run ({len(missing)} missing, "
                        f"{len(unexpected)} unexpected tensors, e.g. {example}); was it another network or model?")
    for key, tensor in weights.items():
        if tuple(saved.weights[key].shape) != tuple(tensor.shape):
            raise UserError(f"--resume {where}: {key} has shape {tuple(saved.weights[key].shape)} in the state "
                            f"but {tuple(tensor.shape)} in this run; resume with the flags it was trained with")


# Flags that may differ on resume without a word: where the run writes and what its files are called, when it
# saves, samples, validates and logs, what its metadata says, how many loader workers read the data. None of
# them changes what is trained (docs/resume.md). The shape flags are refused (check_shapes), not warned about.
RESUME_FREE_FLAGS = frozenset({
    "resume", "output_dir", "output_name", "logging_dir", "log_prefix", "log_with", "log_tracker_name",
    "log_tracker_config", "log_config", "log_every_n_steps", "log_tflops", "wandb_run_name", "training_comment",
    "no_metadata", "no_sample_grid", "validate_every_n_steps", "validate_every_n_epochs", "max_validation_steps",
    "max_data_loader_n_workers", "persistent_data_loader_workers", "profile_steps", "profile_microbatches",
    "profiler_trace_dir", "profiler_trace_steps",
})
RESUME_FREE_PREFIXES = ("save_", "sample_", "metadata_")
# Rates the saved optimizer's parameter groups and the scheduler's base rates restore over the new values.
RESTORED_RATE_FLAGS = frozenset({"--learning_rate", "--unet_lr", "--text_encoder_lr"})


def as_json(flags: dict[str, Any]) -> dict[str, Any]:
    """The values as train_state.json holds them (tuples become lists, anything else not JSON a string)."""
    return json.loads(json.dumps(flags, default=str))


def changed_flags(saved: dict[str, Any], current: dict[str, Any], refused: set[str] = frozenset()) -> list[str]:
    """`--name old -> new` for every flag whose value differs from the saved run's, in the order of `current`.
    Left out: RESUME_FREE_FLAGS, the `refused` (shape) flags, and flags the saved run did not record."""
    current = as_json(current)
    changes = []
    for name, value in current.items():
        if name in refused or name in RESUME_FREE_FLAGS or name.startswith(RESUME_FREE_PREFIXES):
            continue
        if name in saved and saved[name] != value:
            changes.append(f"--{name} {_shown(saved[name])} -> {_shown(value)}")
    return changes


def _shown(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, list):
        return "[" + " ".join(map(str, value)) + "]"
    return str(value)


def warn_changed_flags(saved: SavedState, flags: dict[str, Any], where: str) -> list[str]:
    """One warning line naming every flag that differs from the saved run's (the shape flags are refused before)."""
    changes = changed_flags(saved.flags, flags, set(saved.shape_settings))
    if changes:
        rates = any(change.split(" ", 1)[0] in RESTORED_RATE_FLAGS for change in changes)
        logger.warning("--resume %s: these flags differ from the saved run: %s%s", where, ", ".join(changes),
                       " (the learning rates go on from the saved optimizer and scheduler)" if rates else "")
    return changes


def choose_state(where: Optional[str], output_dir: str, rank: int = 0) -> Optional[SavedState]:
    """--resume: the state to continue from (None: start fresh); "auto" takes the newest intact one.
    `rank`: which process's RNGs to read (data parallel)."""
    if not where:
        return None
    if where != "auto":
        if not os.path.isdir(where):
            raise UserError(f"--resume {where}: folder not found")
        try:
            return read_state(where, rank)
        except DamagedState as e:
            raise UserError(f"--resume {e}") from None
    for path in state_folders(output_dir):
        try:
            saved = read_state(path, rank)
        except DamagedState as e:
            logger.warning("--resume auto: skipping %s", e)
            continue
        logger.info("--resume auto: newest intact state is %s", path)
        return saved
    logger.info("--resume auto: no saved state in %s; starting fresh", output_dir)
    return None
