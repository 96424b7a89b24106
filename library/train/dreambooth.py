"""train_db.py's --stop_text_encoder_training N: the text encoder trains for the first N optimizer steps, then is
frozen (sd-scripts' train_db.py: requires_grad off, its outputs computed without gradients from then on)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class StopTextEncoderTraining:
    """A trainer hook (RunSettings.hooks): after optimizer step `at_step`, freeze every text encoder."""

    def __init__(self, at_step: int):
        self.at_step = at_step

    def __call__(self, trainer, event: str, step: int) -> None:
        if event != "step" or step != self.at_step:
            return
        for encoder in trainer.components.text_encoders:
            for p in encoder.parameters():
                p.requires_grad_(False)
                p.grad = None  # optimizers skip a parameter without a gradient: it stays as trained so far
        trainer.ctx.train_text_encoder = False
        logger.info("--stop_text_encoder_training: text encoder frozen after step %d", step)
