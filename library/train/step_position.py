"""--initial_step / --initial_epoch / --skip_until_initial_step: where a run starts counting, as sd-scripts'
train_network.py places it.

- `--initial_step N` (or `--initial_epoch E`, N = (E-1) * steps per epoch) with `--skip_until_initial_step`: the
  run starts as if N optimizer steps were done: step N+1 of epoch 1 + N // steps-per-epoch, on the same batches an
  uninterrupted run would see there (the first N steps' batches are skipped, not trained), and trains up to
  --max_train_steps. The learning-rate schedule starts from its beginning unless --resume restored it.
- without `--skip_until_initial_step`: only the epoch number moves (training starts at epoch 1 + N // steps per
  epoch, from step 0), as sd-scripts does "for informative purpose"; fewer epochs remain, so a run limited by
  --max_train_epochs trains fewer steps.
- with `--resume`: the state's weights, optimizer, scheduler and RNGs are restored, and the position the state
  recorded is replaced by this one (sd-scripts: "steps from the state is ignored"), with a warning.
"""

from __future__ import annotations

import logging
from typing import Optional

from library.core.errors import ConfigError
from library.train.state import TrainProgress

logger = logging.getLogger(__name__)


def initial_progress(initial_step: Optional[int], initial_epoch: Optional[int], skip_until_initial_step: bool,
                     steps_per_epoch: int, accumulation: int, max_train_steps: int,
                     resumed: Optional[TrainProgress] = None) -> Optional[TrainProgress]:
    """The position the run starts from, or None when neither flag is given (then a resumed state's own)."""
    if initial_step is None and initial_epoch is None:
        return None
    steps = initial_step if initial_step is not None else (initial_epoch - 1) * steps_per_epoch
    if resumed is not None and resumed.global_step:
        logger.warning("--initial_step/--initial_epoch: the step the state recorded (%d) is replaced by %d, as "
                       "in sd-scripts", resumed.global_step, steps)
    if steps <= 0:
        return TrainProgress()
    if steps >= max_train_steps:
        raise ConfigError(f"--initial_step {steps}: expected fewer than --max_train_steps ({max_train_steps})")
    epoch = 1 + steps // steps_per_epoch
    if not skip_until_initial_step:
        logger.info("--initial_step %d without --skip_until_initial_step: starting at epoch %d, step 0", steps, epoch)
        return TrainProgress(epoch=epoch)
    logger.info("--skip_until_initial_step: skipping the batches of %d steps; training steps %d to %d", steps,
                steps + 1, max_train_steps)
    return TrainProgress(epoch=epoch, global_step=steps, batches_done=(steps % steps_per_epoch) * accumulation)
