"""Metric logging: TensorBoard (sd-scripts' scalar names) and a loss window for the progress bar."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Optional

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


class Tracker:
    """Writes scalars to TensorBoard when enabled; a no-op otherwise."""

    def __init__(self, log_with: Optional[str], logging_dir: Optional[str], log_prefix: Optional[str],
                 tracker_name: Optional[str] = None, resume_step: int = 0):
        self.writer = None
        self.log_dir = None
        if log_with in ("tensorboard", "all"):
            if not logging_dir:
                raise ConfigError("--log_with tensorboard: needs --logging_dir")
            from torch.utils.tensorboard import SummaryWriter

            stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())
            self.log_dir = os.path.join(logging_dir, f"{log_prefix or ''}{stamp}", tracker_name or "network_train")
            self.writer = SummaryWriter(self.log_dir, purge_step=resume_step or None)
        if log_with in ("wandb", "all"):
            logger.warning("--log_with wandb is not supported yet; logging to TensorBoard only")

    def log(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_image(self, tag: str, image_hwc, step: int) -> None:
        if self.writer is not None:
            self.writer.add_image(tag, image_hwc, step, dataformats="HWC")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
