"""DatasetPlan: the validated samples, bucket groups and caches of every dataset, and the plan of its batches.

It is plain data plus planning; loading (loading.py), latent caching (latent_caching.py) and metadata
(metadata.py) are functions of it, and TrainingData (dataset.py) puts them together for the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from library.data.batching import (
    BatchRef,
    Group,
    ResolutionSchedule,
    Sample,
    active_groups,
    chunk_group,
    plan_epoch,
    process_batches,
)
from library.data.config import DatasetConfig, SubsetConfig
from library.data.latent_cache import LatentCacheEntry
from library.data.options import DataOptions


@dataclass
class DataFamilyInfo:
    """What the data layer needs from the model family."""
    bucket_reso_multiple: int = 64
    latent_cache_arch: str = "_sd"
    vae_scale_factor: int = 8
    latent_channels: int = 4
    # sd-scripts' newer caches (Flux) suffix every key with the latent size, `latents_<h>x<w>`, so one
    # file holds an image at several resolutions; None keeps the plain SD/SDXL keys.
    latent_cache_key_stride: Optional[int] = None

    @classmethod
    def from_family(cls, family) -> "DataFamilyInfo":
        """From a library.families ModelFamily (its class attributes of the same names)."""
        return cls(family.bucket_reso_multiple, family.latent_cache_arch, family.vae_scale_factor, family.latent_channels,
                   family.latent_cache_key_stride)


@dataclass
class DatasetPlan:
    """Samples, bucket groups and caches of every dataset, and the batch plan (library/data/dataset.py's
    TrainingData adds loading, latent caching and metadata on top)."""
    opts: DataOptions
    family: DataFamilyInfo
    seed: int
    datasets: list[DatasetConfig]
    subsets: list[SubsetConfig]  # all subsets, flattened; Sample.subset indexes this
    samples: list[Sample]
    groups: list[Group]
    group_resolution_index: list[int]  # index of each group's resolution in its dataset's list
    from_config_file: bool
    num_train_images: int = 0  # with repeats, as sd-scripts counts them
    num_reg_images: int = 0
    num_validation_images: int = 0
    max_train_steps: int = 0
    gradient_accumulation_steps: int = 1
    rank: int = 0  # this process, of world_size data-parallel processes (each takes its share of every epoch)
    world_size: int = 1
    schedule: ResolutionSchedule = field(default_factory=ResolutionSchedule)
    latents: dict[tuple[int, int], LatentCacheEntry] = field(default_factory=dict)  # (sample id, group id)
    latent_signatures: dict[tuple[int, int], str] = field(default_factory=dict)  # CacheSettings of each entry
    bad_paths: set[str] = field(default_factory=set)  # failed to decode during caching
    # Image files the scan left out, with why (unreadable, too small, too elongated, broken links); logged once
    # before training and kept for the end-of-run report.
    skipped_images: dict[str, str] = field(default_factory=dict)

    # --- planning -----------------------------------------------------------------
    def shard(self, rank: int, world_size: int) -> None:
        """Data parallel: this is process `rank` of `world_size`; every epoch's batches are shared out (plan_epoch).
        Call before batches_per_epoch() and plan()."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of {world_size} processes")
        self.rank, self.world_size = rank, world_size

    def plan(self, max_train_steps: int, gradient_accumulation_steps: int) -> None:
        """Fix the step budget: token warmup fractions and the progressive resolution schedule depend on it."""
        self.max_train_steps = max_train_steps
        self.gradient_accumulation_steps = max(1, gradient_accumulation_steps)
        progressive = {i: ds.resolution_step_fractions for i, ds in enumerate(self.datasets)
                       if ds.resolution_schedule == "progressive"}
        self.schedule = ResolutionSchedule.build(progressive, max_train_steps)

    def bucketing(self, group: Group) -> bool:
        return self.datasets[group.dataset].enable_bucket

    def _active(self, step: int) -> list[int]:
        return active_groups(self.groups, self.group_resolution_index, self.schedule, step)

    def batches_per_epoch(self) -> int:
        """This process's batches in a full epoch at the start of training (progressive: at the first resolution)."""
        return sum(process_batches(self.groups[g], self.world_size) for g in self._active(0))

    def epoch_batches(self, epoch: int, start_step: int) -> list[BatchRef]:
        """The batches of `epoch` (1-based) starting at global step `start_step`; deterministic in (seed, epoch).

        With a progressive schedule an epoch ends early where the resolution changes, so
        the next epoch starts at the new resolution (an epoch never mixes resolutions).
        """
        boundary = self.schedule.next_boundary(start_step)
        limit = (boundary - start_step) * self.gradient_accumulation_steps if boundary is not None else None
        return plan_epoch(self.groups, self._active(start_step), self.seed, epoch, start_step,
                          self.gradient_accumulation_steps, limit, self.rank, self.world_size,
                          self.opts.keep_bucket_order)

    def num_epochs(self) -> int:
        """Epochs needed to reach max_train_steps (after plan()); constant-length epochs unless progressive."""
        step, epochs = 0, 0
        while step < self.max_train_steps:
            epochs += 1
            n = len(self.epoch_batches(epochs, step))
            if n == 0:
                break
            step += math.ceil(n / self.gradient_accumulation_steps)
        return epochs

    def validation_batches(self) -> list[BatchRef]:
        """Fixed validation batches (repeats 1, no augmentation); empty without a split."""
        refs: list[BatchRef] = []
        for gid, group in enumerate(self.groups):
            if not group.validation:
                continue
            for bucket, ids in chunk_group(group, None):
                refs.append(BatchRef(epoch=0, index=len(refs), step=0, group=gid, bucket=bucket, samples=ids, validation=True))
        return refs

    def resolution_for_metadata(self) -> tuple[int, int]:
        """(width, height) for modelspec.resolution: the largest resolution of the first dataset."""
        return max(self.datasets[0].resolutions, key=lambda r: r[0] * r[1])
