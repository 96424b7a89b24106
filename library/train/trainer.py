"""The one training loop for every family and for adapters and full fine-tunes alike: a recipe that reads top to bottom.

setup (`run()` here): processes (library/train/setup_processes.py, `ProcessSetup`) -> data (validated first, before
any model is loaded) -> model -> what trains (a `Trainable`) -> latent cache (library/train/setup_model.py,
`ModelSetup`) -> optimizer/scheduler -> EMA -> resume (here). train (library/train/loop.py, `TrainingLoop`): epochs of
planned batches, gradient accumulation, clipping, logging, validation, saving, clean stop on signals.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from library.core.errors import ConfigError, UserError
from library.core.io_utils import clean_stale_temporaries
from library.families.base import ModelFamily
from library.objectives.losses import check_loss_options
from library.train.memory.checkpoint_policy import SAVED_OPS, keeps_products
from library.train.memory.compile import compile_blocks
from library.train.distributed.distributed import (
    StepModule,
    StepTrace,
    data_parallel,
    unused_parameters_possible,
)
from library.train.distributed.context_parallel import apply_context_parallel
from library.train.distributed.tensor_parallel import apply_tensor_parallel
from library.train.optim.ema import EMA
from library.train.optim.fused_backward import FusedBackwardOptimizer
from library.train.loop import InterruptedTraining, TrainingError, TrainingLoop  # noqa: F401 (re-exported)
from library.train.optim.lr_schedulers import create_scheduler, lr_log_names
from library.train.memory.memory_setup import park_cached_parts
from library.train.optim.optimizers import create_optimizer, is_schedule_free
from library.train.observe.profiling import Instruments
from library.train.settings import RunSettings
from library.train.setup_model import ModelSetup
from library.train.setup_processes import ProcessSetup
from library.train.debug_dataset import print_batches
from library.train.hub import HubUploader, download_state
from library.train.saving import RunSaver, resume
from library.train.step_position import initial_progress
from library.train.state import RunState
from library.train.step import StepContext
from library.train.stopping import StopHandler
from library.train.speedups import use_channels_last, use_fused_lora
from library.train.observe.tracking import Tracker
from library.train.adapters.trainables import Trainable

logger = logging.getLogger(__name__)


class Trainer(ProcessSetup, ModelSetup, TrainingLoop):
    """One run: `run()` sets everything up from the settings and trains; every attribute is listed here."""

    def __init__(self, family: ModelFamily, settings: RunSettings, stop: Optional[StopHandler] = None):
        self.family = family
        self.s = settings
        self.t = settings.training
        self.stop = stop  # installed by the entry script at process start; run() installs one otherwise
        self.skipped_images: set[str] = set()
        # set up by run(), in this order
        self.accelerator = self.device = self.weight_dtype = None
        # the DeepSpeed config (ZeroConfig; library/train/distributed/deepspeed_engine.py) when the run is under DeepSpeed:
        # --deepspeed or an accelerate DeepSpeed config
        self.zero = None
        self.run_state: Optional[RunState] = None  # progress + every RNG: what a state folder restores
        self.data = None
        self.batches_per_epoch = self.steps_per_epoch = self.max_train_steps = self.num_epochs = 0
        self.components = None
        self.block_swapper = None
        self.trainable: Optional[Trainable] = None
        self.network = None  # the trainable's module as accelerate prepared it
        self.optimizer = self.lr_scheduler = None
        self.optimizer_name = self.optimizer_descr = None
        self.group_names: list[str] = []
        self.lr_names: list[str] = []
        self.schedule_free = False
        self.ema: Optional[EMA] = None
        self.ctx: Optional[StepContext] = None  # the family, model, noise scheme and losses every step uses
        self.instruments = Instruments(None, None, None)  # timing and FLOPs (library/train/observe/profiling.py)
        self.text_cached_encoders: frozenset[int] = frozenset()  # filled by _cache_text_outputs
        self.tracker: Optional[Tracker] = None
        self.session_id = 0
        self.started_at = 0.0
        self.saver: Optional[RunSaver] = None  # made once training starts
        # The trained weights with the batch loss as forward; DDP-wrapped with several processes (distributed.py)
        self.step_module: Optional[torch.nn.Module] = None
        self.trace: Optional[StepTrace] = None
        self.step_logs: dict[str, float] = {}
        # (token, its vectors spelled out) of multi-vector textual-inversion tokens: sample prompts spell them out
        self.prompt_replacements: tuple[tuple[str, str], ...] = ()

    @property
    def noise_generator(self) -> torch.Generator:
        return self.run_state.noise_generator

    @property
    def fused_backward(self) -> bool:
        ft = self.s.fine_tune
        return bool(ft and (ft.fused_backward_pass or ft.fused_optimizer_groups or ft.blockwise_fused_optimizers))

    @property
    def trained_encoders(self) -> frozenset[int]:
        return self.trainable.trained_encoders if self.trainable else frozenset()

    @property
    def train_text_encoder(self) -> bool:
        return bool(self.trainable and self.trainable.train_text_encoder)

    # ------------------------------------------------------------------ setup
    def _setup_optimizer(self) -> None:
        groups, self.group_names = self.trainable.parameter_groups(self.s.optimizer.learning_rate)
        self.optimizer, self.optimizer_name, self.optimizer_descr = create_optimizer(groups, self.s.optimizer)
        if self.fused_backward:
            if is_schedule_free(self.optimizer):
                raise UserError(f"--fused_backward_pass / --fused_optimizer_groups / --blockwise_fused_optimizers: not "
                                f"with the schedule-free "
                                f"{self.optimizer_name}")
            inner_type = type(self.optimizer)
            block_of = self.trainable.optimizer_blocks() if self.s.fine_tune.blockwise_fused_optimizers else None
            self.optimizer = FusedBackwardOptimizer(self.optimizer.param_groups, inner_type,
                                                    self.s.optimizer.max_grad_norm,
                                                    self.s.fine_tune.fused_optimizer_groups, block_of)
            if block_of is not None:
                logger.info("--blockwise_fused_optimizers: %d optimizers (%s)", len(self.optimizer.chunks),
                            ", ".join(self.optimizer.chunk_names))
        self.lr_scheduler = create_scheduler(self.optimizer, self.s.scheduler, self.max_train_steps,
                                             self.optimizer_descr)
        self.lr_names = lr_log_names(self.group_names)
        if self.zero is not None:
            self._setup_deepspeed()
        elif self.accelerator.num_processes > 1:
            # DDP wraps a StepModule (trained weights + the loss as forward), not the network, whose own forward
            # a LoRA never calls (library/train/distributed/distributed.py); DDP broadcasts rank 0's weights at the start.
            self.network = self.trainable.module
            self.optimizer = self.accelerator.prepare(self.optimizer)
        else:
            # The module is already placed (apply_memory_options); moving it would bring swapped blocks back.
            self.network, self.optimizer = self.accelerator.prepare(self.trainable.module, self.optimizer,
                                                                    device_placement=[False, True])
        t = self.t
        if self.zero is None:
            self.step_module = StepModule(self.network, self._batch_loss)
        if self.fsdp is None and self.zero is None and t.tensor_parallel_size == 1:  # FSDP / DeepSpeed reduce
            # the gradients themselves; tensor parallelism's processes train one batch (DTensor reduces)
            dropout = self.s.network.network_args.get("module_dropout") if self.trainable.is_adapter else None
            unused = unused_parameters_possible(bool(self.trained_encoders), dropout) \
                or self.family.denoiser_leaves_weights_unused
            self.step_module = data_parallel(self.step_module, self.device, unused, t.ddp_gradient_as_bucket_view,
                                             t.ddp_static_graph)
        if isinstance(self.step_module, DistributedDataParallel):
            ddp = self.step_module
            self.trace.meta["ddp"] = {"static_graph": ddp.static_graph, "find_unused_parameters":
                                      ddp.find_unused_parameters, "gradient_as_bucket_view": ddp.gradient_as_bucket_view}
        self.schedule_free = is_schedule_free(self.optimizer)
        if self.s.ema.use_ema:
            self.ema = EMA(self.trainable.module, self.s.ema, self.device)

    def _resume(self) -> None:
        where = self.t.resume
        if where and self.t.hub.resume_from_huggingface:  # every process downloads the state it reads
            where = download_state(where, self.t.hub.token)
        resume(where, self.t.output_dir, self.max_train_steps, self.trainable, self.optimizer,
               self.lr_scheduler, getattr(self.accelerator, "scaler", None), self.ema, self.run_state,
               self.accelerator.process_index, self.accelerator.num_processes)

    def cache_latents_only(self) -> None:
        """Build the latent cache this run would use, then stop (tools/cache_latents.py)."""
        self._setup_accelerator()
        self._setup_data()
        self.components, self.block_swapper = self._setup_model()
        self._cache_latents()

    def cache_text_outputs_only(self) -> None:
        """Build the text-encoder output cache this run would use, then stop (tools/cache_text_encoder_outputs.py)."""
        self._setup_accelerator()
        self._setup_data()
        self.components, self.block_swapper = self._setup_model()
        self.ctx, self.instruments = self._setup_step_context()  # no trainable: the encoders stay frozen
        self._cache_text_outputs()

    def _setup_step_context(self) -> tuple[StepContext, Instruments]:
        """The StepContext every step (and the text cache) encodes with, and the step's timing instruments."""
        scheme = self.family.noise_scheme(self.components, zero_terminal_snr=self.s.zero_terminal_snr)
        check_loss_options(self.s.loss, scheme)
        if self.trainable is not None and not self.trainable.is_adapter and any(
                sub.custom_attributes.get("diff_output_preservation") for sub in self.data.subsets):
            raise ConfigError("custom_attributes.diff_output_preservation: only for network (LoRA) training, where "
                              "the base model's prediction is the network at multiplier 0 (as sd-scripts)")
        ctx = StepContext(
            family=self.family, components=self.components, scheme=scheme, noise=self.s.noise,
            loss=self.s.loss, device=self.device, weight_dtype=self.weight_dtype, clip_skip=self.s.text.clip_skip,
            max_token_length=self.s.text.max_token_length, train_text_encoder=self.train_text_encoder,
            autocast=self.accelerator.autocast, weighted_captions=self.s.text.weighted_captions, adapter_off=getattr(self.trainable, "adapter_off", None),
            before_predict=getattr(self.trainable, "before_predict", None))
        ddp = self.step_module if isinstance(self.step_module, DistributedDataParallel) else None
        saved_ops = SAVED_OPS.get(self.s.memory.gradient_checkpointing_policy, frozenset())
        return ctx, Instruments.for_run(self.t, self.device, ddp, self.accelerator.is_main_process, saved_ops)

    def debug_dataset(self) -> int:
        """--debug_dataset: print the first epoch's batches; no model loads. Returns the number of batches."""
        self._setup_accelerator()
        self._setup_data()
        if not self.accelerator.is_main_process:
            return 0
        if self.t.debug_dataset_dir:
            os.makedirs(self.t.debug_dataset_dir, exist_ok=True)
        return print_batches(self.data, image_dir=self.t.debug_dataset_dir)

    # ------------------------------------------------------------------ run
    def run(self) -> str:
        """Train; returns the path of the final model or network file."""
        own_handler = self.stop is None
        if own_handler:
            self.stop = StopHandler()
        try:
            if own_handler:
                self.stop.install()
            self._setup_accelerator()
            self._setup_data()
            self.components, self.block_swapper = self._setup_model()
            if self.t.context_parallel_size > 1:
                apply_context_parallel(self.components.denoiser, self.t.context_parallel_size, self.device)
            tp = apply_tensor_parallel(self.components.denoiser, self.t.tensor_parallel_size, self.device) \
                if self.t.tensor_parallel_size > 1 else None
            self.trainable = self._setup_trainable()
            if tp is not None:  # the LoRA follows the sharded Linears; saves gather it whole
                self.trainable.sharding = tp
                tp.shard_adapter(self.trainable.module)
            self.prompt_replacements += getattr(self.trainable, "prompt_replacements", ())
            if self.fsdp is None and self.zero is None:  # sharding flattens or splits the weights itself
                scale = self.family.vae_scale_factor
                use_channels_last(self.components.denoiser, self.s.speed, self.device,
                                  [(w // scale, h // scale) for ds in self.data.datasets for w, h in ds.resolutions])
                # plain tensors, eager modules, and no product output kept by a selective checkpointing policy
                if tp is None and not self.t.compile.torch_compile \
                        and not keeps_products(self.s.memory.gradient_checkpointing_policy):
                    use_fused_lora(self.trainable.module, self.s.speed)
            if self.fsdp is not None:
                self._shard()
            if self.t.compile.torch_compile:  # after the adapter hooks in: the first step traces them too
                compile_blocks(self.components.denoiser, self.family.block_classes, self.t.compile)
            self._cache_latents()  # shared out between the processes
            self._setup_optimizer()
            self.ctx, self.instruments = self._setup_step_context()
            self._cache_text_outputs()  # shared out between the processes
            if not self.t.highvram:
                park_cached_parts(self.components, self.device, self.s.data.cache_latents, self.text_cached_encoders)
            self._resume()
            start = initial_progress(self.t.initial_step, self.t.initial_epoch, self.t.skip_until_initial_step,
                                     self.steps_per_epoch, self.t.gradient_accumulation_steps, self.max_train_steps,
                                     self.run_state.progress if self.t.resume else None)
            if start is not None:
                self.run_state.progress = start
            self.session_id = uuid.uuid4().int & ((1 << 31) - 1)
            self.started_at = time.time()
            if self.accelerator.is_main_process:
                os.makedirs(self.t.output_dir, exist_ok=True)
                for path in clean_stale_temporaries(self.t.output_dir, self.t.output_name):
                    logger.info("removed %s, left by a run that was killed while saving", path)
            self.accelerator.wait_for_everyone()
            self.saver = RunSaver(self.t, self.s.ema, self.trainable, self.components, self.optimizer,
                                  self.optimizer_name, self.lr_scheduler, self.run_state, self.accelerator, self.ema,
                                  self._metadata, self.num_epochs, self.max_train_steps, self._nan_hint())
            if self.t.hub.repo_id and self.accelerator.is_main_process:
                self.saver.uploader = HubUploader(self.t.hub)
            if self.accelerator.is_main_process:
                self.saver.check_disk_space()
                self.tracker = Tracker.for_run(self.t, resume_step=self.run_state.progress.global_step)
            else:  # only the main process writes TensorBoard events / wandb
                self.tracker = Tracker(None, None, None)
            self.stop.in_loop = True
            return self._train()
        finally:
            if self.saver is not None and self.saver.uploader is not None:
                self.saver.uploader.wait()  # a stopped or failed run still lets its uploads end
            self.stop.in_loop = False
            if own_handler:
                self.stop.uninstall()
            if self.tracker is not None:
                self.tracker.close()
            self._report()

    def _report(self) -> None:
        """The end-of-run summary, however the run ended."""
        if self.run_state is not None and self.started_at:
            steps = self.run_state.progress.global_step
            saved = (self.saver and self.saver.last_saved) or "nothing"
            if self.accelerator is not None and not self.accelerator.is_main_process:
                saved = "(the main process saves)"
            logger.info("run ended at step %d of %d after %.0f s; last saved: %s", steps, self.max_train_steps,
                        time.time() - self.started_at, saved)
        scanned = self.data.skipped_images if self.data is not None else {}
        if scanned:
            logger.warning("%d file(s) were left out when the dataset was scanned:\n  %s", len(scanned),
                           "\n  ".join(f"{path}: {why}" for path, why in sorted(scanned.items())))
        if self.skipped_images:
            logger.warning("%d image(s) failed to decode during training and were skipped:\n  %s",
                           len(self.skipped_images), "\n  ".join(sorted(self.skipped_images)))

    def _on_signal(self, signum, frame) -> None:  # tests simulate a signal through this
        self.stop._on_signal(signum, frame)
