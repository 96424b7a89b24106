"""The processes of a run, set up by `Trainer` (library/train/trainer.py): the accelerator, DeepSpeed, FSDP
sharding, context parallelism, and one seed for every process. `ProcessSetup` is that part of `Trainer`; it fills in
the attributes `Trainer.__init__` lists.
"""

from __future__ import annotations

import logging

import torch

from library.core.errors import UserError
from library.train.distributed.distributed import (
    StepModule,
    StepTrace,
    gather_objects,
    lone_process_note,
    make_accelerator,
)
from library.train.distributed.deepspeed_engine import (
    ZeroConfig,
    ZeroEngine,
    accelerate_without_deepspeed,
    launched_with_deepspeed,
)
from library.train.distributed.deepspeed_engine import unsupported as deepspeed_unsupported
from library.train.distributed.context_parallel import check_context_parallel
from library.train.distributed.tensor_parallel import check_tensor_parallel, lora_dropout
from library.train.distributed.sharding import (
    FsdpSettings,
    broadcast_module_states,
    fsdp_unsupported,
    shard_parts,
    sync_done_here,
)
from library.train.state import RunState

logger = logging.getLogger("library.train.trainer")  # one logger name for the whole trainer (tests filter on it)

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ProcessSetup:
    """The process setup methods of `Trainer`."""

    def _setup_accelerator(self) -> None:
        t = self.t
        if t.deepspeed is not None or launched_with_deepspeed():
            self.zero = ZeroConfig(t.deepspeed, cpu=t.cpu)
            why = deepspeed_unsupported(self.zero.stage, self.s)
            if why:
                raise UserError(f"DeepSpeed ({self.zero.describe()}): {why}")
        fsdp = FsdpSettings.from_env() if self.zero is None else None  # read first: a bad FSDP_* value stops here
        with sync_done_here(fsdp), accelerate_without_deepspeed():  # DeepSpeed: the engine takes model, optimizer
            self.accelerator = make_accelerator(t.mixed_precision, t.cpu, t.ddp_timeout, t.ddp_backend)
        n = self.accelerator.num_processes
        if n > 1:
            self._agree_on_seed()
            t = self.t
        if self.zero is not None:
            logger.info("DeepSpeed: %s, %d process(es)", self.zero.describe(), n)
        elif n > 1:
            if self.fused_backward:
                raise UserError(f"--fused_backward_pass / --fused_optimizer_groups / --blockwise_fused_optimizers: not "
                                f"with {n} processes "
                                "(parameters step inside backward, before the processes' gradients could be averaged)")
            logger.info("data parallel: process %d of %d (%s)", self.accelerator.process_index, n,
                        self.accelerator.distributed_type)
        note = lone_process_note(n)  # `accelerate launch --cpu --num_processes 2` runs one process
        if note:
            logger.warning(note)
        self.device = self.accelerator.device
        if self.s.textual_inversion is not None and (self.zero is not None or (fsdp is not None and n > 1)):
            raise UserError("textual inversion: not under FSDP or DeepSpeed (a few vectors train; plain data "
                            "parallel, as sd-scripts runs it)")
        self.fsdp = fsdp if n > 1 else None
        if self.fsdp is not None:
            why = fsdp_unsupported(self.s, self.fsdp)
            if why:
                raise UserError(f"FSDP (ACCELERATE_USE_FSDP from the accelerate config): {why}")
        check_context_parallel(t.context_parallel_size, self.family, n, **self._context_parallel_run())
        run = {k: v for k, v in self._context_parallel_run().items() if k != "family_refusal"}
        check_tensor_parallel(t.tensor_parallel_size, self.family, n, cp_size=t.context_parallel_size,
                              fp8=self.s.memory.fp8_base, ema=self.s.ema.use_ema, fine_tune=self.s.network is None
                              or self.s.controlnet is not None or self.s.textual_inversion is not None,
                              dropout=lora_dropout(self.s.network), **run)
        self.weight_dtype = DTYPES[t.mixed_precision]
        self.run_state = RunState.start(t.seed, self.accelerator.process_index, flags=self.s.flags)
        self.trace = StepTrace(self.accelerator.process_index)

    def _context_parallel_run(self) -> dict:
        """What of the run --context_parallel_size cannot go with (context_parallel_problem's keywords)."""
        return dict(fsdp=self.fsdp is not None, deepspeed=self.zero is not None, compile=self.t.compile.torch_compile,
                    blocks_to_swap=self.s.memory.blocks_to_swap or 0,
                    family_refusal=self.family.context_parallel_refusal(self.s.model.family_options
                                                                        or self.family.options_type()))

    def _agree_on_seed(self) -> None:
        """Every process takes rank 0's seed. Without --seed each process drew its own, and the epochs' batch plans,
        the per-sample draws and the initial weights are functions of it: with different seeds the processes would
        train on overlapping batches."""
        agreed = gather_objects(self.t.seed)[0]
        if agreed != self.t.seed:
            self.s = self.s.with_seed(agreed)
            self.t = self.s.training

    def _shard(self) -> None:
        """FSDP: a fine-tune's trained parts, or the frozen parts a LoRA hooks into with its modules inside."""
        c, adapters = self.components, None
        if self.trainable.is_adapter:
            parts = {"denoiser": c.denoiser, **{f"text_encoder{i + 1}": te for i, te in enumerate(c.text_encoders)}}
            adapters = self.trainable.module
        else:
            parts = dict(self.trainable.module.items())
        if self.fsdp.sync_module_states:  # rank 0's weights everywhere, before each process keeps its shards
            sent = broadcast_module_states([c.denoiser, c.vae, *c.text_encoders, self.trainable.module])
            logger.info("FSDP: %d tensors synchronised from rank 0 (fsdp_sync_module_states)", sent)
        checkpointed = frozenset({"denoiser"} if self.t.gradient_checkpointing else ())  # the family's own
        self.trainable.sharding, counts = shard_parts(parts, self.fsdp, self.family.block_classes, adapters,
                                                      checkpointed, self.device)
        for name, units in counts.items():
            logger.info("FSDP%d: %s sharded over %d processes in %d units%s", self.fsdp.version, name,
                        self.accelerator.num_processes, units,
                        ", activation checkpointing" if self.fsdp.activation_checkpointing else "")

    def _setup_deepspeed(self) -> None:
        """The engine around the StepModule and the run's optimizer (which keeps its parameter groups: the schedule and
        the lr logs still read them)."""
        t = self.t
        self.network = self.trainable.module
        config = self.zero.complete(self.s.data.train_batch_size, t.gradient_accumulation_steps,
                                    self.accelerator.num_processes, self.s.optimizer.max_grad_norm,
                                    t.mixed_precision, client_optimizer=True)
        self.step_module = ZeroEngine(StepModule(self.network, self._batch_loss), self.optimizer, config,
                                      self.zero.stage, self.zero.save_16bit)
        self.trainable.engine = self.step_module
