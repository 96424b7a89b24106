"""The one training loop for every family: a recipe that reads top to bottom.

setup: data (validated first, before any model is loaded) -> model -> network ->
latent cache -> optimizer/scheduler -> resume. train: epochs of planned batches,
gradient accumulation, clipping, logging, validation, saving, clean stop on signals.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
import uuid
from typing import Optional

import torch
from tqdm.auto import tqdm

from library.core.errors import UserError
from library.data.dataset import BatchDataset, DataFamilyInfo, build_training_data
from library.data.te_cache import (
    cache_source_id,
    check_text_cache_allowed,
    subset_caption_settings,
)
from library.families.base import ModelFamily
from library.objectives.losses import check_loss_options
from library.train import checkpoints as ckpt
from library.train.lr_schedulers import create_scheduler, lr_log_names, lr_logs
from library.train.memory_setup import apply_memory_options, park_cached_parts
from library.train.network_kinds import build_network, merge_base_weights
from library.train.network_setup import (
    load_network_weights,
    optimizer_groups,
    save_network,
    trained_text_encoders,
)
from library.train.optimizers import create_optimizer, is_schedule_free
from library.train.run_metadata import RunFacts, lora_metadata
from library.train.settings import RunSettings
from library.train.state import TrainProgress, resume_progress, save_state
from library.train.step import StepContext, batch_loss, optimizer_step
from library.train.text_caching import build_step_text_cache
from library.train.throughput import ThroughputMeter
from library.train.tracking import LossWindow, Tracker
from library.train.validation import validation_loss

logger = logging.getLogger(__name__)

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TrainingError(UserError):
    """Training cannot go on (e.g. a NaN loss); the last saved files stay valid."""




class NetworkTrainer:
    def __init__(self, family: ModelFamily, settings: RunSettings):
        self.family = family
        self.s = settings
        self.t = settings.training
        self._stop_signal: Optional[int] = None
        self.skipped_images: set[str] = set()

    # ------------------------------------------------------------------ setup
    def _setup_accelerator(self) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(mixed_precision=self.t.mixed_precision, cpu=self.t.cpu)
        self.device = self.accelerator.device
        self.weight_dtype = DTYPES[self.t.mixed_precision]
        from accelerate.utils import set_seed

        set_seed(self.t.seed)  # python, numpy and torch RNGs
        self.noise_generator = torch.Generator("cpu").manual_seed(self.t.seed)

    def _setup_data(self) -> None:
        info = DataFamilyInfo.from_family(self.family)
        self.data = build_training_data(self.s.data, info)
        accum = self.t.gradient_accumulation_steps
        self.batches_per_epoch = self.data.batches_per_epoch()
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / accum)
        if self.t.max_train_epochs:
            self.max_train_steps = self.t.max_train_epochs * self.steps_per_epoch
        else:
            self.max_train_steps = self.t.max_train_steps
        self.data.plan(self.max_train_steps, accum)
        self.num_epochs = self.data.num_epochs()
        self.text_cache_opts = self.s.text_cache
        self.text_cached_encoders: frozenset[int] = frozenset()  # filled by _cache_text_outputs
        if self.text_cache_opts.enabled:  # refused before any model loads when captions are random
            check_text_cache_allowed(subset_caption_settings(self.data), self.s.network.train_text_encoder,
                                     splittable=bool(self.family.text_encoder_outputs))

    def _setup_model(self) -> None:
        self.components = self.family.load(self.s.model)
        c = self.components
        for m in [c.denoiser, c.vae, *c.text_encoders]:
            m.requires_grad_(False)
            m.eval()
        vae_dtype = torch.float32 if self.s.no_half_vae else self.weight_dtype
        c.vae.to(self.device, vae_dtype)
        for m in [c.denoiser, *c.text_encoders]:
            m.to(dtype=self.weight_dtype)  # placed by apply_memory_options: swapped blocks stay in CPU memory
        if self.s.network.base_weights:  # merged before any float8 cast
            merge_base_weights(self.s.network_kind, self.family, c, self.s.network)
        self.block_swapper = apply_memory_options(self.family, c, self.s.memory, self.device,
                                                  self.t.gradient_checkpointing)

    def _setup_network(self) -> None:
        opts = self.s.network
        self.network = build_network(self.s.network_kind, self.family, self.components, opts,
                                     fp8_base=self.s.memory.fp8_base)
        train_unet = opts.train_unet
        train_te = opts.train_text_encoder
        te = self.components.text_encoders if len(self.components.text_encoders) > 1 else self.components.text_encoders[0]
        self.network.apply_to(te, self.components.denoiser, train_te, train_unet)
        self.name_map = self.s.network_kind.name_map(self.family, self.components)
        if opts.network_weights and not opts.dim_from_weights:
            info = load_network_weights(self.network, self.family, opts.network_weights, self.name_map)
            logger.info("loaded network weights from %s: %s", opts.network_weights, info)
        self.train_text_encoder = train_te
        self.trained_encoders = trained_text_encoders(self.network, self.components) if train_te else frozenset()
        net_dtype = torch.float32
        if self.t.full_fp16:
            net_dtype = torch.float16
        elif self.t.full_bf16:
            net_dtype = torch.bfloat16
        self.network.to(self.device, net_dtype)
        if self.t.gradient_checkpointing and hasattr(self.network, "enable_gradient_checkpointing"):
            self.network.enable_gradient_checkpointing()
        if hasattr(self.network, "prepare_grad_etc"):
            self.network.prepare_grad_etc(te, self.components.denoiser)

    def _cache_latents(self) -> None:
        d = self.s.data
        if not d.cache_latents:
            return
        vae = self.components.vae
        vae_id = cache_source_id(self.s.model.vae or self.s.model.pretrained_model_name_or_path, vae.dtype,
                                 self.family.latent_cache_values(self.family.options(self.components)), weights=vae)
        self.data.cache_latents(lambda images: self.family.encode_images(vae, images.to(vae.device, vae.dtype)),
                                vae_id=vae_id, to_disk=d.cache_latents_to_disk, batch_size=d.vae_batch_size,
                                num_workers=d.data_loader_workers())

    def _setup_optimizer(self) -> None:
        opts = self.s.network
        groups, self.group_names = optimizer_groups(self.network, opts, self.s.optimizer.learning_rate)
        self.optimizer, self.optimizer_name, self.optimizer_descr = create_optimizer(groups, self.s.optimizer)
        self.lr_scheduler = create_scheduler(self.optimizer, self.s.scheduler, self.max_train_steps,
                                             self.optimizer_descr)
        self.lr_names = lr_log_names(self.group_names)
        self.network, self.optimizer = self.accelerator.prepare(self.network, self.optimizer)
        self.schedule_free = is_schedule_free(self.optimizer)

    def _resume(self) -> TrainProgress:
        return resume_progress(self.t.resume, self.t.output_dir, self.max_train_steps,
                               self.accelerator.unwrap_model(self.network), self.optimizer, self.lr_scheduler,
                               {"noise": self.noise_generator}, getattr(self.accelerator, "scaler", None))

    def _cache_text_outputs(self) -> None:
        if self.text_cache_opts.enabled:
            self.text_cached_encoders = build_step_text_cache(self.ctx, self.data, self.s, self.trained_encoders,
                                                              self.max_train_steps)

    def cache_latents_only(self) -> None:
        """Build the latent cache this run would use, then stop (tools/cache_latents.py)."""
        self._setup_accelerator()
        self._setup_data()
        self._setup_model()
        self._cache_latents()

    def cache_text_outputs_only(self) -> None:
        """Build the text-encoder output cache this run would use, then stop (tools/cache_text_encoder_outputs.py)."""
        self._setup_accelerator()
        self._setup_data()
        self._setup_model()
        self.train_text_encoder = False  # no network is built: the encoders stay frozen
        self.trained_encoders = frozenset()
        self._setup_step_context()
        self._cache_text_outputs()

    def _setup_step_context(self) -> None:
        """The noise scheme and the StepContext every step (and the text cache) encodes with."""
        self.scheme = self.family.noise_scheme(self.components, zero_terminal_snr=self.s.zero_terminal_snr)
        check_loss_options(self.s.loss, self.scheme)
        self.ctx = StepContext(
            family=self.family, components=self.components, scheme=self.scheme, noise=self.s.noise,
            loss=self.s.loss, device=self.device, weight_dtype=self.weight_dtype, clip_skip=self.s.text.clip_skip,
            max_token_length=self.s.text.max_token_length, train_text_encoder=self.train_text_encoder,
            autocast=self.accelerator.autocast)
        self.meter = ThroughputMeter(self.t.log_tflops, self.device, self.t.gradient_checkpointing) \
            if self.t.log_tflops else None

    # ------------------------------------------------------------------ run
    def run(self) -> str:
        """Train; returns the path of the final LoRA file."""
        self._setup_accelerator()
        self._setup_data()
        self._setup_model()
        self._setup_network()
        self._cache_latents()
        self._setup_optimizer()
        self._setup_step_context()
        self._cache_text_outputs()
        park_cached_parts(self.components, self.device, self.s.data.cache_latents, self.text_cached_encoders)
        progress = self._resume()
        self.session_id = uuid.uuid4().int & ((1 << 31) - 1)
        self.started_at = time.time()
        os.makedirs(self.t.output_dir, exist_ok=True)
        self.tracker = Tracker(self.t.log_with, self.t.logging_dir, self.t.log_prefix, self.t.log_tracker_name,
                               resume_step=progress.global_step)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            return self._train(progress)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.tracker.close()
            if self.skipped_images:
                logger.warning("%d image(s) failed to decode during training and were skipped:\n  %s",
                               len(self.skipped_images), "\n  ".join(sorted(self.skipped_images)))

    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:
            raise KeyboardInterrupt  # a second Ctrl+C stops at once
        self._stop_signal = signum
        logger.warning("signal %d: saving state after the current step, then stopping", signum)

    def _train(self, progress: TrainProgress) -> str:
        accum = self.t.gradient_accumulation_steps
        global_step = progress.global_step
        loss_window = LossWindow(self.batches_per_epoch)
        bar = tqdm(total=self.max_train_steps, initial=global_step, desc="steps", smoothing=0.1,
                   disable=not self.accelerator.is_local_main_process)
        logger.info("training: %d images, %d batches/epoch, %d epochs, %d steps, grad accumulation %d",
                    self.data.num_train_images, self.batches_per_epoch, self.num_epochs, self.max_train_steps, accum)
        self.network.train()
        if self.schedule_free:
            self.optimizer.train()
        self._run_hooks("train_start", global_step)
        for epoch in range(progress.epoch, self.num_epochs + 1):
            skip = progress.batches_done if epoch == progress.epoch else 0
            epoch_start_step = global_step - skip // accum
            refs = self.data.epoch_batches(epoch, epoch_start_step)
            unwrapped = self.accelerator.unwrap_model(self.network)
            if hasattr(unwrapped, "on_epoch_start"):
                te = self.components.text_encoders
                unwrapped.on_epoch_start(te if len(te) > 1 else te[0], self.components.denoiser)
            loader = torch.utils.data.DataLoader(
                BatchDataset(self.data, refs[skip:]), batch_size=None, shuffle=False,
                num_workers=self.s.data.data_loader_workers(),
                persistent_workers=False,
                # Its own generator: creating an iterator must not draw from the global RNG, or a
                # resumed run (which creates one mid-epoch) would diverge from an uninterrupted one.
                generator=torch.Generator().manual_seed(self.t.seed + epoch))
            epoch_losses: list[float] = []
            for i, batch in enumerate(loader, start=skip):
                last_in_group = (i + 1) % accum == 0 or i == len(refs) - 1
                if batch is not None:
                    self.skipped_images.update(batch.get("skipped_images") or [])
                    loss = self._micro_step(batch, global_step, last_in_group)
                    epoch_losses.append(loss)
                    loss_window.add(loss)
                if not last_in_group:
                    continue
                self._optimizer_step()
                global_step += 1
                bar.update(1)
                self._log_step(global_step, loss_window, epoch_losses[-1] if epoch_losses else float("nan"), bar)
                self._log_throughput(global_step)
                done = global_step >= self.max_train_steps
                batches_done = i + 1 if i + 1 < len(refs) else 0
                next_epoch = epoch if batches_done else epoch + 1
                with self._untimed():
                    self._after_step(global_step, TrainProgress(next_epoch, global_step, batches_done), done)
                if self._stop_signal is not None:
                    return self._stop(TrainProgress(next_epoch, global_step, batches_done))
                if done:
                    break
            with self._untimed():
                self._after_epoch(epoch, global_step, epoch_losses)
            if global_step >= self.max_train_steps:
                break
        bar.close()
        return self._finish(global_step, epoch)

    def _micro_step(self, batch: dict, global_step: int, sync: bool) -> float:
        accumulating = not sync and self.accelerator.num_processes > 1
        ctx = self.accelerator.no_sync(self.network) if accumulating else contextlib.nullcontext()
        meter = self.meter.count if self.meter else _null_phase
        with ctx:
            with meter("forward"):
                loss, _ = batch_loss(self.ctx, batch, self.noise_generator)
            if not torch.isfinite(loss):
                paths = ", ".join(batch.get("image_paths", [])[:8])
                raise TrainingError(f"step {global_step + 1}: loss is {loss.item()} (not finite); stopping. "
                                    f"Images in this batch: {paths}. The files saved so far are intact; "
                                    f"try --mixed_precision bf16 or fp32, --no_half_vae, or a lower learning rate")
            with meter("backward"):
                self.accelerator.backward(loss / self.t.gradient_accumulation_steps)
            if self.block_swapper is not None:
                self.block_swapper.release()
        return loss.item()

    def _optimizer_step(self) -> None:
        opts = self.s
        optimizer_step(self.optimizer, self.lr_scheduler,
                       opts.optimizer.max_grad_norm if self.accelerator.sync_gradients else None,
                       self.accelerator.clip_grad_norm_)
        if opts.network.scale_weight_norms:
            unwrapped = self.accelerator.unwrap_model(self.network)
            self.last_max_norm = unwrapped.apply_max_norm_regularization(opts.network.scale_weight_norms, self.device)

    def _log_step(self, step: int, window: LossWindow, current: float, bar) -> None:
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        bar.set_postfix(loss=f"{window.average:.4f}", lr=f"{lrs[0]:.2e}", refresh=False)
        if step % self.t.log_every_n_steps:
            return
        values = {"loss/current": current, "loss/average": window.average}
        values.update(lr_logs(self.lr_scheduler, self.optimizer, self.lr_names, adaptive=self.optimizer_descr.adaptive))
        if self.s.network.scale_weight_norms and getattr(self, "last_max_norm", None):
            keys_scaled, mean_norm, max_norm = self.last_max_norm
            values.update({"max_norm/keys_scaled": keys_scaled, "max_norm/average_key_norm": mean_norm,
                           "max_norm/max_key_norm": max_norm})
        self.tracker.log(values, step)

    def _untimed(self):
        """Sampling, saving and validation are not step time for --log_tflops."""
        return self.meter.paused() if self.meter else contextlib.nullcontext()

    def _log_throughput(self, step: int) -> None:
        report = self.meter.step_done(step) if self.meter else None
        if report is not None:
            logger.info("step %d: %s", step, report.line())
            self.tracker.log(report.as_scalars(), step)

    # ------------------------------------------------------------------ after steps / epochs
    def _after_step(self, step: int, progress: TrainProgress, done: bool) -> None:
        t = self.t
        plan = self._save_plan()
        if plan.save_at_step(step, self.max_train_steps):
            self._save_and_rotate(ckpt.step_stem(t.output_name, step), progress, step, progress.epoch,
                                  plan.step_to_remove(step, for_state=False),
                                  plan.step_to_remove(step, for_state=True), ckpt.step_stem)
        if t.validate_every_n_steps and step % t.validate_every_n_steps == 0:
            self._validate(step, "step")
        self._run_hooks("step", step)

    def _after_epoch(self, epoch: int, step: int, losses: list[float]) -> None:
        t = self.t
        if losses:
            self.tracker.log({"loss/epoch_average": sum(losses) / len(losses)}, epoch)
        plan = self._save_plan()
        if plan.save_at_epoch(epoch, self.num_epochs) and step < self.max_train_steps:
            self._save_and_rotate(ckpt.epoch_stem(t.output_name, epoch), TrainProgress(epoch + 1, step, 0), step,
                                  epoch, plan.epoch_to_remove(epoch, for_state=False),
                                  plan.epoch_to_remove(epoch, for_state=True), ckpt.epoch_stem)
        if t.validate_every_n_epochs and epoch % t.validate_every_n_epochs == 0:
            self._validate(epoch, "epoch")
        self._run_hooks("epoch", step)

    def _save_and_rotate(self, stem: str, progress: TrainProgress, step: int, epoch: int,
                         old_model: Optional[int], old_state: Optional[int], stem_of) -> None:
        """Save the model (and state) under `stem`; remove the ones that fell out of retention."""
        t = self.t
        self._save_model(ckpt.model_path(t.output_dir, stem, t.save_model_as), step, epoch)
        if old_model:
            ckpt.remove_path(ckpt.model_path(t.output_dir, stem_of(t.output_name, old_model), t.save_model_as))
        if t.save_state:
            self._save_state(ckpt.state_path(t.output_dir, stem), progress)
            if old_state:
                ckpt.remove_path(ckpt.state_path(t.output_dir, stem_of(t.output_name, old_state)))

    def _save_plan(self) -> ckpt.SavePlan:
        t = self.t
        every_epochs = t.save_every_n_epochs
        if t.save_n_epoch_ratio:
            every_epochs = max(1, math.floor(self.num_epochs / t.save_n_epoch_ratio))
        return ckpt.SavePlan(every_epochs, t.save_every_n_steps, t.save_last_n_epochs, t.save_last_n_epochs_state,
                             t.save_last_n_steps, t.save_last_n_steps_state)

    def _validate(self, at: int, kind: str) -> None:
        refs = self.data.validation_batches()
        if not refs:
            return
        if self.t.max_validation_steps:
            refs = refs[: self.t.max_validation_steps]
        self.network.eval()
        value = validation_loss(self.ctx, self.data, refs, seed=self.s.data.validation_seed or self.t.seed)
        self.network.train()
        self.tracker.log({f"loss/validation/{kind}_average": value}, at)
        logger.info("validation loss at %s %d: %.5f", kind, at, value)

    def _run_hooks(self, event: str, step: int) -> None:
        for hook in self.s.hooks:
            hook(self, event, step)

    # ------------------------------------------------------------------ saving
    def _metadata(self, step: int, epoch: int) -> dict:
        facts = RunFacts(self.session_id, self.started_at, step, epoch, self.num_epochs, self.max_train_steps,
                         self.batches_per_epoch, self.t.seed, self.optimizer_descr.ss_optimizer)
        return lora_metadata(self.family, self.components, self.s, self.data, facts)

    def _save_model(self, path: str, step: int, epoch: int) -> None:
        if not self.accelerator.is_main_process:
            return
        save_network(self.accelerator.unwrap_model(self.network), path, self.t.save_precision,
                     self._metadata(step, epoch), self.name_map)
        logger.info("saved %s", path)

    def _save_state(self, state_dir: str, progress: TrainProgress) -> None:
        if not self.accelerator.is_main_process:
            return
        save_state(state_dir, self.accelerator.unwrap_model(self.network).state_dict(), self.optimizer,
                   self.lr_scheduler, progress, {"noise": self.noise_generator},
                   getattr(self.accelerator, "scaler", None))
        logger.info("saved state %s", state_dir)

    def _stop(self, progress: TrainProgress) -> str:
        stem = ckpt.step_stem(self.t.output_name, progress.global_step)
        self._save_state(ckpt.state_path(self.t.output_dir, stem), progress)
        raise InterruptedTraining(self._stop_signal or signal.SIGINT, ckpt.state_path(self.t.output_dir, stem))

    def _finish(self, step: int, epoch: int) -> str:
        t = self.t
        if self.schedule_free:
            self.optimizer.eval()
        path = ckpt.model_path(t.output_dir, t.output_name, t.save_model_as)
        self._save_model(path, step, epoch)
        if t.save_state or t.save_state_on_train_end:
            self._save_state(ckpt.state_path(t.output_dir, t.output_name), TrainProgress(epoch + 1, step, 0))
        self._run_hooks("train_end", step)
        return path


class InterruptedTraining(Exception):
    """Raised after a signal once the state is saved; the entry script exits with 128 + signal."""

    def __init__(self, signum: int, state_dir: str):
        super().__init__(f"stopped by signal {signum}; state saved to {state_dir} (resume with --resume {state_dir})")
        self.signum = signum
        self.state_dir = state_dir


def _null_phase(phase: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()
