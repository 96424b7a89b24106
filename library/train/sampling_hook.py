"""Sample images during training: a trainer hook (see RunSettings.hooks).

When: --sample_at_first (at the start), every --sample_every_n_steps steps and
after every --sample_every_n_epochs epochs. Unlike sd-scripts, both intervals
may be set and sampling happens at either; where both fall on the same step the
images are made once, named by the step.

Sampling leaves training untouched: the RNG states (Python, NumPy, torch, CUDA
and the trainer's noise generator) are captured before and restored after, the
network goes back to train mode and its multiplier, and a schedule-free
optimizer goes back to train mode. A run with sampling therefore trains
bitwise the same LoRA as one without.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from library.families.common.embeddings import expand_prompt
from library.sampling.generate import PromptOverrides, requests_from_prompts
from library.sampling.image_networks import generate_with_image_networks
from library.sampling.output import SAMPLE_DIR, progress_suffix, save_samples
from library.sampling.prompts import SamplePrompt

logger = logging.getLogger(__name__)


@dataclass
class SamplingOptions:
    """--sample_* flags (translated in library/cli/sampling.py)."""
    sample_prompts: Optional[str] = None
    sample_every_n_steps: Optional[int] = None
    sample_every_n_epochs: Optional[int] = None
    sample_at_first: bool = False
    sample_sampler: Optional[str] = None
    sample_batch_size: int = 1
    sample_grid: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.sample_prompts) and bool(
            self.sample_at_first or self.sample_every_n_steps or self.sample_every_n_epochs)


class SampleHook:
    """Callable `hook(trainer, event, step)` that samples on the events the options ask for."""
    def __init__(self, options: SamplingOptions, prompts: Sequence[SamplePrompt]):
        self.options = options
        self.prompts = list(prompts)
        self.last_sampled_step: Optional[int] = None
        self.paths: list[str] = []  # every file written (for tests and logs)

    def due(self, event: str, step: int, steps_per_epoch: int) -> Optional[tuple[str, Optional[int]]]:
        """(file name suffix, epoch or None) when `event` at `step` calls for samples, else None."""
        o = self.options
        if event == "train_start" and o.sample_at_first:
            return (progress_suffix(step, 0), 0) if step == 0 else (progress_suffix(step), None)
        if event == "sample_now":  # asked during the run (library/train/control.py)
            return progress_suffix(step), None
        if event == "step" and o.sample_every_n_steps and step % o.sample_every_n_steps == 0:
            return progress_suffix(step), None
        if event == "epoch" and o.sample_every_n_epochs and step != self.last_sampled_step:
            # The trainer reports the step; every epoch but a cut-short last one has steps_per_epoch steps.
            epoch = math.ceil(step / max(1, steps_per_epoch))
            if epoch % o.sample_every_n_epochs == 0:
                return progress_suffix(step, epoch), epoch
        return None

    def __call__(self, trainer, event: str, step: int) -> None:
        due = self.due(event, step, getattr(trainer, "steps_per_epoch", 1))
        if due is None:
            return
        suffix, epoch = due
        accelerator = trainer.accelerator
        # Under FSDP (and ZeRO-3) every process holds a shard of the model, so every process runs the generation (the
        # weights are gathered block by block); only the main one writes the images. Context parallelism's denoiser
        # splits every forward's tokens over the processes: all of them take part too.
        trainable = getattr(trainer, "trainable", None)
        sharded = getattr(trainable, "sharded", False) or getattr(trainable, "weights_partitioned", False) \
            or getattr(getattr(trainer, "t", None), "context_parallel_size", 1) > 1
        if accelerator.is_main_process or sharded:
            self.sample(trainer, step, epoch, suffix, write=accelerator.is_main_process)
        self.last_sampled_step = step
        accelerator.wait_for_everyone()

    def sample(self, trainer, step: int, epoch: Optional[int], suffix: str, write: bool = True) -> list[str]:
        """Generate every prompt with the current network and save / log the images (`write`)."""
        rng_state = trainer.run_state.capture_rng()
        network = trainer.accelerator.unwrap_model(trainer.network)
        was_training = network.training
        old_multiplier = getattr(network, "multiplier", None)
        schedule_free = getattr(trainer, "schedule_free", False)
        generated = []
        try:
            if schedule_free:
                trainer.optimizer.eval()  # sample with the averaged weights, as the final model will be
            network.eval()
            user_multiplier = getattr(trainer.s.network, "network_multiplier", None) if trainer.s.network else None
            if user_multiplier is not None and hasattr(network, "set_multiplier"):
                network.set_multiplier(user_multiplier)
            # Seeds of prompts without --d come from their own generator, never the training RNG.
            overrides = PromptOverrides(sampler=self.options.sample_sampler)
            requests = requests_from_prompts(self.prompts, overrides=overrides, rng=random.Random())
            spelled = getattr(trainer, "prompt_replacements", ())  # multi-vector textual-inversion tokens
            if spelled:
                requests = [dataclasses.replace(r, prompt=expand_prompt(r.prompt, spelled),
                                                negative_prompt=expand_prompt(r.negative_prompt, spelled))
                            for r in requests]
            logger.info("sampling %d image(s) at step %d", len(requests), step)
            with trainer.accelerator.autocast(), trainer.eval_weights("sampling"):
                # a ControlNet-LLLite network gets each prompt's --cn image (the last batch's images fit no sample)
                generated = generate_with_image_networks(trainer.family, trainer.components, [network], requests,
                                                         clip_skip=trainer.s.text.clip_skip, device=trainer.device,
                                                         batch_size=self.options.sample_batch_size)
            if not write:
                return []
            t = trainer.t
            current_epoch = epoch if epoch is not None else math.ceil(step / max(1, trainer.steps_per_epoch))
            extra = {"step": step, "epoch": current_epoch, "model": t.output_name}
            paths = save_samples(generated, os.path.join(t.output_dir, SAMPLE_DIR), t.output_name, suffix,
                                 extra=extra, grid=self.options.sample_grid)
            for g in generated:
                trainer.tracker.log_image(f"sample/{g.request.index:02d}", np.asarray(g.image), step)
            self.paths += paths
            return paths
        finally:
            network.train(was_training)
            if old_multiplier is not None and hasattr(network, "set_multiplier"):
                network.set_multiplier(old_multiplier)
            if schedule_free:
                trainer.optimizer.train()
            trainer.run_state.restore_rng(rng_state)
            del generated
            gc.collect()  # give the sampling activations back before training resumes
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
