"""Metric logging: TensorBoard (sd-scripts' scalar names) and a loss window for the progress bar."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any, Mapping, Optional

from library.core.errors import ConfigError

logger = logging.getLogger(__name__)


class LossWindow:
    """Moving average over the last `size` losses (sd-scripts' loss/average is a one-epoch window)."""

    def __init__(self, size: int):
        self.values: deque[float] = deque(maxlen=max(1, size))

    def add(self, value: float) -> float:
        self.values.append(value)
        return self.average

    @property
    def average(self) -> float:
        return sum(self.values) / len(self.values) if self.values else float("nan")


WANDB_MISSING = ("--log_with wandb needs the wandb package: pip install wandb (or, in this repository: "
                 "pip install .[wandb])")


def wandb_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


class Tracker:
    """Writes scalars (sd-scripts' names) to TensorBoard and/or Weights & Biases, as --log_with asks; a no-op
    otherwise.

    `init_kwargs` is --log_tracker_config's table: {"tensorboard": {...}, "wandb": {...}}, passed to
    SummaryWriter and wandb.init as accelerate does. wandb runs as configured by its environment (WANDB_MODE=offline
    writes under WANDB_DIR, or --logging_dir, without an account).
    """

    def __init__(self, log_with: Optional[str], logging_dir: Optional[str], log_prefix: Optional[str],
                 tracker_name: Optional[str] = None, resume_step: int = 0, *, wandb_run_name: Optional[str] = None,
                 wandb_api_key: Optional[str] = None, init_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 run_config: Optional[Mapping[str, Any]] = None):
        self.writer = None
        self.log_dir = None
        self.wandb_run = None
        self._wandb_step = -1
        init_kwargs = init_kwargs or {}
        if log_with in ("tensorboard", "all"):
            if not logging_dir:
                raise ConfigError("--log_with tensorboard: needs --logging_dir")
            from torch.utils.tensorboard import SummaryWriter

            stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())
            self.log_dir = os.path.join(logging_dir, f"{log_prefix or ''}{stamp}", tracker_name or "network_train")
            self.writer = SummaryWriter(self.log_dir, purge_step=resume_step or None,
                                        **dict(init_kwargs.get("tensorboard", {})))
            if run_config:  # TensorBoard hparams take scalars only (lists written as text)
                self.writer.add_hparams({k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                         for k, v in run_config.items()}, {}, run_name=".")
        if log_with in ("wandb", "all"):
            self.wandb_run = _start_wandb(tracker_name or "network_train", wandb_run_name, wandb_api_key, logging_dir,
                                          dict(init_kwargs.get("wandb", {})), run_config)

    @classmethod
    def for_run(cls, t: Any, resume_step: int = 0) -> "Tracker":
        """The tracker a run's TrainingOptions ask for."""
        return cls(t.log_with, t.logging_dir, t.log_prefix, t.log_tracker_name, resume_step=resume_step,
                   wandb_run_name=t.wandb_run_name, wandb_api_key=t.wandb_api_key, init_kwargs=t.log_tracker_config,
                   run_config=t.log_config)

    def log(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        if self.wandb_run is not None:
            if step >= self._wandb_step:  # wandb's step only goes up
                self._wandb_step = step
                self.wandb_run.log(dict(values), step=step)
            else:  # per-epoch values (loss/epoch_average): at the current step, same names
                self.wandb_run.log(dict(values))

    def log_image(self, tag: str, image_hwc, step: int) -> None:
        if self.writer is not None:
            self.writer.add_image(tag, image_hwc, step, dataformats="HWC")
        if self.wandb_run is not None:
            import wandb

            self.log({tag: wandb.Image(image_hwc)}, step)  # type: ignore[dict-item]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _start_wandb(project: str, run_name: Optional[str], api_key: Optional[str], logging_dir: Optional[str],
                 kwargs: dict[str, Any], run_config: Optional[Mapping[str, Any]] = None):
    """wandb.init as accelerate calls it for sd-scripts (project = --log_tracker_name, name = --wandb_run_name)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(WANDB_MISSING) from None
    if api_key:  # sd-scripts calls wandb.login(key=...); the environment variable does the same without a request
        os.environ["WANDB_API_KEY"] = api_key
    kwargs.setdefault("project", project)
    if run_name:
        kwargs.setdefault("name", run_name)
    if run_config:
        kwargs["config"] = {**dict(run_config), **dict(kwargs.get("config") or {})}
    if logging_dir and "dir" not in kwargs and not os.environ.get("WANDB_DIR"):
        os.makedirs(logging_dir, exist_ok=True)
        kwargs["dir"] = logging_dir
    logger.info("wandb: project %s%s (mode %s)", kwargs["project"], f", run {run_name}" if run_name else "",
                os.environ.get("WANDB_MODE", "online"))
    return wandb.init(**kwargs)
