"""The data and the model of a run, set up by `Trainer` (library/train/trainer.py): the training data (checked
before any model loads), the loaded model under the memory options, what trains (a `Trainable`), and the latent and
text-encoder output caches. `ModelSetup` is that part of `Trainer`; it fills in the attributes `Trainer.__init__`
lists.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch

from library.core.errors import UserError
from library.data.dataset import DataFamilyInfo, build_training_data
from library.data.cache_share import CacheShare
from library.data.te_cache import (
    cache_source_id,
    check_text_cache_allowed,
    subset_caption_settings,
)
from library.families.base import Components
from library.train.distributed.distributed import gather_objects, load_in_turns
from library.train.distributed.context_parallel import check_context_parallel, data_rank
from library.train.memory.block_swap import BlockSwapper
from library.train.memory.memory_setup import apply_memory_options
from library.train.adapters.network_kinds import merge_base_weights
from library.train.step import encode_with_vae
from library.train.text_caching import build_step_text_cache, start_auto_text_cache
from library.train.adapters.controlnet import ControlNetTrainable
from library.train.adapters.textual_inversion import TextualInversionTrainable, caption_rules, load_embeddings
from library.train.adapters.trainables import AdapterTrainable, ModelTrainable, Trainable, fine_tune_plan

logger = logging.getLogger("library.train.trainer")  # one logger name for the whole trainer (tests filter on it)


class ModelSetup:
    """The data and model setup methods of `Trainer`."""

    def _setup_data(self) -> None:
        info = DataFamilyInfo.from_family(self.family, self.s.model.family_options)
        self.data = build_training_data(self.s.data, info)
        accum = self.t.gradient_accumulation_steps
        n = self.accelerator.num_processes
        self.data.shard(*data_rank(self.accelerator.process_index, n,
                                   self.t.context_parallel_size * self.t.tensor_parallel_size))
        check_context_parallel(self.t.context_parallel_size, self.family, n,
                               [b for g in self.data.groups for b in g.buckets], **self._context_parallel_run())
        self.batches_per_epoch = self.data.batches_per_epoch()  # this process's share
        if self.batches_per_epoch == 0:
            raise UserError(f"{n} processes but only {self._all_batches()} "
                            "batch(es) per epoch: every process needs at least one; use fewer processes or a "
                            "smaller --train_batch_size")
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / accum)
        if self.t.max_train_epochs:
            self.max_train_steps = self.t.max_train_epochs * self.steps_per_epoch
        else:
            self.max_train_steps = self.t.max_train_steps
        self.data.plan(self.max_train_steps, accum)
        if self.s.textual_inversion is not None:  # the token spelled out in captions, or templates instead of them
            self.data.caption_replacements, self.data.caption_templates = caption_rules(self.s.textual_inversion)
        self.num_epochs = self.data.num_epochs()
        if self.s.text_cache.enabled:  # refused before any model loads when captions are random
            train_te = self.s.fine_tune.train_text_encoder if self.s.fine_tune else self.s.network.train_text_encoder
            check_text_cache_allowed(subset_caption_settings(self.data), train_te,
                                     splittable=bool(self.family.text_encoder_outputs))

    def _all_batches(self) -> int:
        """Batches of a whole epoch, over every process."""
        share = self.data.rank, self.data.world_size
        self.data.shard(0, 1)
        try:
            return self.data.batches_per_epoch()
        finally:
            self.data.shard(*share)

    def _full_dtype(self) -> torch.dtype:
        """The dtype of trained weights: float32 unless --full_bf16 / --full_fp16."""
        return torch.float16 if self.t.full_fp16 else torch.bfloat16 if self.t.full_bf16 else torch.float32

    def _setup_model(self) -> tuple[Components, Optional[BlockSwapper]]:
        """The loaded model, frozen and placed under the memory options, and the block swapper (or None)."""
        c = load_in_turns(lambda: self.family.load(self.s.model), self.accelerator, self.t.lowram)
        self.family.check_loaded(c, self.s.text)  # --clip_skip against the loaded encoders
        if self.s.network is not None and self.s.network.embeddings:  # tokens of frozen embeddings in captions
            self.prompt_replacements = load_embeddings(self.family, c, self.s.network.embeddings)
            self.data.caption_replacements = self.prompt_replacements
        for m in [c.denoiser, c.vae, *c.text_encoders]:
            m.requires_grad_(False)
            m.eval()
        vae_dtype = torch.float32 if self.s.no_half_vae else self.weight_dtype
        c.vae.to(self.device, vae_dtype)
        trained = self._fine_tune_parts(c)
        parts = {"denoiser": c.denoiser, **{f"text_encoder{i + 1}": te for i, te in enumerate(c.text_encoders)}}
        for name, m in parts.items():  # placed by apply_memory_options: swapped blocks stay in CPU memory
            m.to(dtype=self._full_dtype() if name in trained else self.weight_dtype)
        if self.s.network is not None and self.s.network.base_weights:  # merged before any float8 cast
            merge_base_weights(self.s.network_kind, self.family, c, self.s.network)
        block_swapper = apply_memory_options(self.family, c, self.s.memory, self.device,
                                             self.t.gradient_checkpointing,
                                             steps_in_backward=bool(trained) and self.fused_backward)
        self.family.prepare_for_data(c, [r for ds in self.data.datasets for r in ds.resolutions])
        return c, block_swapper

    def _fine_tune_parts(self, components: Components) -> dict[str, float]:
        if self.s.fine_tune is None or self.s.controlnet is not None:  # a ControlNet run: the model is frozen
            return {}
        encoders = len(components.text_encoders)
        limit = self.family.fine_tune_text_encoders
        if self.s.fine_tune.train_t5xxl:
            limit = self.family.fine_tune_t5xxl_encoder + 1
        return fine_tune_plan(self.s.fine_tune, self.s.optimizer.learning_rate,
                              encoders if limit is None else min(limit, encoders))

    def _setup_trainable(self) -> Trainable:
        """What trains: the model's own parts (a fine-tune) or a network hooked into it."""
        t = self.t
        if self.s.textual_inversion is not None:
            return TextualInversionTrainable(self.family, self.components, self.s.textual_inversion, t.save_model_as,
                                             t.save_precision, device=self.device, full_dtype=self._full_dtype())
        if self.s.controlnet is not None:
            return ControlNetTrainable(self.family, self.components, self.s.controlnet, t.save_model_as,
                                       t.save_precision, full_dtype=self._full_dtype(), device=self.device,
                                       gradient_checkpointing=t.gradient_checkpointing)
        if self.s.fine_tune is not None:
            return ModelTrainable(self.family, self.components, self._fine_tune_parts(self.components),
                                  self.s.fine_tune, t.save_model_as, t.save_precision, device=self.device,
                                  gradient_checkpointing=t.gradient_checkpointing)
        return AdapterTrainable(self.s.network_kind, self.family, self.components, self.s.network,
                                t.save_model_as, t.save_precision, fp8_base=self.s.memory.fp8_base,
                                full_dtype=self._full_dtype(), device=self.device,
                                gradient_checkpointing=t.gradient_checkpointing)

    def _cache_latents(self) -> None:
        d = self.s.data
        if not d.cache_latents:
            return
        vae = self.components.vae
        vae_id = cache_source_id(self.s.model.vae or self.s.model.pretrained_model_name_or_path, vae.dtype,
                                 self.family.latent_cache_values(self.family.options(self.components)), weights=vae)
        share = self._cache_share(gather=not d.cache_latents_to_disk)  # each process encodes its share
        cache = functools.partial(self.data.cache_latents,
                                  lambda images: encode_with_vae(self.family, vae, images),
                                  vae_id=vae_id, to_disk=d.cache_latents_to_disk, batch_size=d.vae_batch_size,
                                  num_workers=d.data_loader_workers())
        cache(share=share)
        if share is not None and d.cache_latents_to_disk:
            self.accelerator.wait_for_everyone()
            cache()  # reads what the other processes wrote (and retries what failed, alike on every process)

    def _cache_share(self, gather: bool = True) -> Optional[CacheShare]:
        """This process's part of building a cache, with several processes (None with one)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return None
        return CacheShare(acc.process_index, acc.num_processes, acc.wait_for_everyone,
                          gather_objects if gather else None)

    def _cache_text_outputs(self) -> None:
        if self.s.text_cache.enabled:
            self.text_cached_encoders = build_step_text_cache(self.ctx, self.data, self.s, self.trained_encoders,
                                                              self.max_train_steps, self._cache_share())
        else:
            start_auto_text_cache(self.ctx, self.data, self.s, self.trained_encoders, self.max_train_steps)
