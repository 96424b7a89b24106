"""The training loop proper: epochs of planned batches, micro-steps, the optimizer step, logging, validation,
saving and a clean stop. `TrainingLoop` is the part of `Trainer` (library/train/trainer.py) that runs once
everything is set up; it uses the attributes the Trainer's setup fills in.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from library.core.errors import UserError
from library.data.dataset import EpochSampler, PlannedBatches
from library.train import checkpoints as ckpt
from library.train.control import serve_requests
from library.train.distributed.context_parallel import loss_scale
from library.train.distributed.distributed import any_process
from library.train.optim.lr_schedulers import lr_logs
from library.train.run_metadata import RunFacts, embedding_metadata, lora_metadata, model_metadata
from library.train.step import batch_loss, optimizer_step
from library.train.stopping import nan_hint
from library.train.observe.tracking import LossWindow
from library.train.validation import validation_loss

logger = logging.getLogger("library.train.trainer")  # one logger name for the whole trainer (tests filter on it)


class TrainingError(UserError):
    """Training cannot go on (e.g. a NaN loss); the last saved files stay valid."""


class InterruptedTraining(Exception):
    """Raised after a signal once the state is saved; the entry script exits with 128 + signal."""

    def __init__(self, signum: int, state_dir: str, why: Optional[str] = None):
        super().__init__(f"stopped {why or f'by signal {signum}'}; state saved to {state_dir} "
                         f"(resume with --resume {state_dir})")
        self.signum = signum
        self.state_dir = state_dir


class TrainingLoop:
    """The loop's methods of `Trainer`."""

    def _train(self) -> str:
        accum = self.t.gradient_accumulation_steps
        start = self.run_state.progress
        global_step = start.global_step
        loss_window = LossWindow(self.batches_per_epoch)
        # Into a file (the web UI's train.log) the bar is written at every step: tqdm skips redraws closer than
        # 0.1 s, so fast steps were missing from the log (the web UI's progress and loss chart read it).
        to_file = not getattr(sys.stderr, "isatty", lambda: False)()
        bar = tqdm(total=self.max_train_steps, initial=global_step, desc="steps", smoothing=0.1,
                   disable=not self.accelerator.is_local_main_process,
                   **({"mininterval": 0, "miniters": 1} if to_file else {}))
        logger.info("training: %d images, %d batches/epoch, %d epochs, %d steps, grad accumulation %d%s",
                    self.data.num_train_images, self.batches_per_epoch, self.num_epochs, self.max_train_steps, accum,
                    f", {self.accelerator.num_processes} processes (batches/epoch per process)"
                    if self.accelerator.num_processes > 1 else "")
        self.network.train()
        if self.schedule_free:
            self.optimizer.train()
        self._run_hooks("train_start", global_step)
        sampler = EpochSampler()
        workers = self.s.data.data_loader_workers()
        loader = torch.utils.data.DataLoader(
            PlannedBatches(self.data), sampler=sampler, batch_size=None, num_workers=workers,
            persistent_workers=self.s.data.persistent_data_loader_workers and workers > 0,
            # Its own generator: creating an iterator must not draw from the global RNG, or a resumed
            # run (which creates one mid-epoch) would diverge from an uninterrupted one. Every random
            # choice of a batch is drawn from its own (seed, epoch, batch, sample) generator.
            generator=torch.Generator().manual_seed(self.t.seed))
        for epoch in range(start.epoch, self.num_epochs + 1):
            skip = start.batches_done if epoch == start.epoch else 0
            refs = self.data.epoch_batches(epoch, global_step - skip // accum)
            self.trainable.on_epoch_start()
            sampler.refs = refs[skip:]
            epoch_losses: list[float] = []
            group_losses: list[float] = []
            for i, batch in enumerate(self.instruments.timed(loader), start=skip):
                last_in_group = (i + 1) % accum == 0 or i == len(refs) - 1
                if i % accum == 0:
                    self.instruments.before_step(global_step + 1)
                self.skipped_images.update(batch["skipped_images"])
                if batch["image_paths"]:  # empty when every image of the batch failed to decode
                    group_losses.append(self._micro_step(batch, global_step, last_in_group))
                    self.trace.batch(batch["image_paths"])
                elif self.accelerator.num_processes > 1:  # join the others' gradient all-reduce with zeros
                    self._micro_step(None, global_step, last_in_group)
                batches_done = i + 1 if i + 1 < len(refs) else 0
                self.run_state.advance(epoch if batches_done else epoch + 1, global_step, batches_done)
                if not last_in_group:
                    continue
                if not group_losses and self.accelerator.num_processes == 1:
                    continue  # every image of the group failed to decode: no step (several processes step together)
                self._optimizer_step(global_step + 1)
                global_step += 1
                epoch_losses.extend(group_losses)
                for loss in group_losses:
                    loss_window.add(loss)
                group_losses = []
                self.run_state.advance(epoch if batches_done else epoch + 1, global_step, batches_done)
                self.trace.step(global_step, epoch, self.trainable.weights().values() if self.trace.active else ())
                bar.update(1)
                if epoch_losses:
                    self._log_step(global_step, loss_window, epoch_losses[-1], bar)
                self._log_throughput(global_step)
                done = global_step >= self.max_train_steps
                with self._untimed():
                    self._after_step(global_step)
                if any_process(self.stop.requested, self.device):  # every process stops at the same step
                    return self._stop()
                if done:
                    break
            with self._untimed():
                self._after_epoch(epoch, global_step, epoch_losses)
            if global_step >= self.max_train_steps:
                break
        bar.close()
        self.instruments.close()
        return self._finish()

    def _batch_loss(self, batch: dict, generator: torch.Generator):
        return batch_loss(self.ctx, batch, generator)

    def _micro_step(self, batch: Optional[dict], global_step: int, sync: bool) -> float:
        """Forward and backward of one batch (None: this process has no images this time, see StepModule). With
        several processes DDP averages the gradients during the backward of the group's last micro-batch; the
        others run under no_sync."""
        phase = self.instruments.phase
        ddp = isinstance(self.step_module, DistributedDataParallel)
        with (self.step_module.no_sync() if ddp and not sync else contextlib.nullcontext()):
            if batch is not None:
                pixels = batch["latents"] if batch.get("latents") is not None else batch.get("images")
                self.instruments.micro_batch(tuple(pixels.shape) if pixels is not None else (),
                                             len(batch["image_paths"]) * self.accelerator.num_processes)
            with phase("forward"):
                loss, _ = self.step_module(batch, self.noise_generator)
            if batch is None:
                self._backward(loss, sync)
                return 0.0
            self._check_finite(loss, batch, global_step)
            with phase("backward"):
                # × the context-parallel size: each process's gradients cover its share of the tokens, and DDP
                # averages over every process (library/train/distributed/context_parallel.py)
                self._backward(loss / self.t.gradient_accumulation_steps * loss_scale(self.t.context_parallel_size),
                               sync)
            self.instruments.micro_done()
        if self.block_swapper is not None:
            self.block_swapper.release()
        return loss.item()

    def _backward(self, loss: torch.Tensor, sync: bool) -> None:
        if self.zero is not None:  # the DeepSpeed engine reduces the gradients at the group's last micro-batch
            self.step_module.backward(loss, sync)
        else:
            self.accelerator.backward(loss)

    def _check_finite(self, loss: torch.Tensor, batch: dict, global_step: int) -> None:
        if not torch.isfinite(loss):
            paths = ", ".join(batch.get("image_paths", [])[:8])
            raise TrainingError(f"step {global_step + 1}: loss is {loss.item()} (not finite); stopping. "
                                f"Images in this batch: {paths}. The files saved so far are intact; "
                                f"{self._nan_hint()}")

    def _nan_hint(self) -> str:
        t = self.t
        return nan_hint(t.mixed_precision, t.full_fp16, t.full_bf16, self.s.no_half_vae,
                        self.s.optimizer.max_grad_norm)

    def _optimizer_step(self, step: int) -> None:
        clip = self.accelerator.sync_gradients and not self.fused_backward  # fused: clipped per parameter
        with self.instruments.phase("optimizer"):
            if self.zero is not None:  # clips by the global norm of the partitioned gradients, steps, zeroes
                self.step_module.step(self.lr_scheduler)
            else:
                reduce = getattr(self.trainable.sharding, "reduce_gradients", None)
                if reduce is not None:  # tensor parallelism over several groups: averaged once per step
                    reduce()
                optimizer_step(self.optimizer, self.lr_scheduler, self.s.optimizer.max_grad_norm if clip else None,
                               getattr(self.trainable.sharding, "clip_grad_norm_", self.accelerator.clip_grad_norm_),
                               before_step=self.trainable.before_optimizer_step if clip else None)
        self.step_logs = self.trainable.after_optimizer_step(self.device)
        if self.ema is not None:
            self.ema.step(step)

    def _log_step(self, step: int, window: LossWindow, current: float, bar) -> None:
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        bar.set_postfix(loss=f"{window.average:.4f}", lr=f"{lrs[0]:.2e}", refresh=False)
        if step % self.t.log_every_n_steps:
            return
        values = {"loss/current": current, "loss/average": window.average}
        values.update(lr_logs(self.lr_scheduler, self.optimizer, self.lr_names, adaptive=self.optimizer_descr.adaptive))
        values.update(self.step_logs)
        self.tracker.log(values, step)

    def _untimed(self):
        """Sampling, saving and validation are not step time (--log_tflops, --profile_steps)."""
        return self.instruments.paused()

    def _log_throughput(self, step: int) -> None:
        report, times = self.instruments.step_done(step)
        if report is not None:
            logger.info("step %d: %s", step, report.line())
            self.tracker.log(report.as_scalars(), step)
        if times is not None:
            logger.info("%s", times.line())
            self.tracker.log(times.scalars(), step)

    # ------------------------------------------------------------------ after steps / epochs
    def _after_step(self, step: int) -> None:
        t = self.t
        self.saver.after_step(step)
        if t.validate_every_n_steps and step % t.validate_every_n_steps == 0:
            self._validate(step, "step")
        self._run_hooks("step", step)
        serve_requests(self, step)  # the web UI's "sample now" / "save now" (library/train/control.py)

    def _after_epoch(self, epoch: int, step: int, losses: list[float]) -> None:
        t = self.t
        if losses:
            self.tracker.log({"loss/epoch_average": sum(losses) / len(losses)}, epoch)
        self.saver.after_epoch(epoch, step)
        if t.validate_every_n_epochs and epoch % t.validate_every_n_epochs == 0:
            self._validate(epoch, "epoch")
        self._run_hooks("epoch", step)

    def eval_weights(self, purpose: str):
        """The EMA weights in place for "sampling" / "validation" when --ema_for_<purpose> (default on)."""
        wanted = {"sampling": self.s.ema.for_sampling, "validation": self.s.ema.for_validation}[purpose]
        return self.ema.swapped_in() if self.ema is not None and wanted else contextlib.nullcontext()

    def _validate(self, at: int, kind: str) -> None:
        refs = self.data.validation_batches()
        if not refs:
            return
        if self.t.max_validation_steps:
            refs = refs[: self.t.max_validation_steps]
        self.network.eval()
        with self.eval_weights("validation"):
            value = validation_loss(self.ctx, self.data, refs, seed=self.s.data.validation_seed or self.t.seed)
        self.network.train()
        self.tracker.log({f"loss/validation/{kind}_average": value}, at)
        logger.info("validation loss at %s %d: %.5f", kind, at, value)

    def _run_hooks(self, event: str, step: int) -> None:
        for hook in self.s.hooks:
            hook(self, event, step)

    def _metadata(self, step: int, epoch: int) -> dict:
        facts = RunFacts(self.session_id, self.started_at, step, epoch, self.num_epochs, self.max_train_steps,
                         self.batches_per_epoch, self.t.seed, self.optimizer_descr.ss_optimizer)
        build = lora_metadata if self.trainable.is_adapter else model_metadata
        if self.s.textual_inversion is not None:
            build = embedding_metadata
        return build(self.family, self.components, self.s, self.data, facts)

    def _stop(self) -> str:
        self.instruments.close()
        progress = self.run_state.progress
        stem = ckpt.step_stem(self.t.output_name, progress.global_step)
        self.saver.save_state(ckpt.state_path(self.t.output_dir, stem), progress)
        if self.stop.requested:
            signum, why = self.stop.signum, self.stop.why
        else:  # the signal reached another process (any_process): this one stops at the same step
            signum, why = signal.SIGTERM, "because another process was asked to stop"
        raise InterruptedTraining(signum, ckpt.state_path(self.t.output_dir, stem), why)

    def _finish(self) -> str:
        progress = self.run_state.progress  # mid-epoch when --max_train_steps ended the run: resume goes on there
        if self.schedule_free:
            self.optimizer.eval()
        path = self.saver.final(progress)
        self._run_hooks("train_end", progress.global_step)
        return path
