"""TrainingData: the planned, validated dataset the training loop reads batches from.

The loop's contract:
    data = build_training_data(opts, family_info)
    data.plan(max_train_steps, gradient_accumulation_steps)
    data.cache_latents(encode, vae_id, to_disk, batch_size, num_workers)   # optional
    for epoch in 1..: refs = data.epoch_batches(epoch, start_step)
        DataLoader(BatchDataset(data, refs), batch_size=None, num_workers=n)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from library.data.batching import BatchRef
from library.data.building import build
from library.data.latent_caching import CacheShare, cache_all_latents
from library.data.loading import load_batch
from library.data.metadata import dataset_metadata
from library.data.options import DataOptions
from library.data.plan import DataFamilyInfo, DatasetPlan


class TrainingData(DatasetPlan):
    """A DatasetPlan that loads its batches, caches its latents and describes itself in metadata."""
    # --- loading --------------------------------------------------------------------
    def load_batch(self, ref: BatchRef) -> dict:
        """The tensors of one batch (see library/data/loading.py); no `image_paths` if none could be decoded."""
        return load_batch(self, ref)

    def cache_latents(self, encode: Callable[[torch.Tensor], torch.Tensor], vae_id: str, to_disk: bool,
                      batch_size: int, num_workers: int, share: Optional[CacheShare] = None) -> None:
        """Encode every image once per bucket (and flipped when flip_aug); memory always, disk when `to_disk`.
        `share`: this process's part with several processes (latent_caching.CacheShare)."""
        cache_all_latents(self, encode, vae_id, to_disk, batch_size, num_workers, share)

    # --- metadata ----------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        """The dataset ss_* metadata (all values strings)."""
        return dataset_metadata(self)


class BatchDataset(torch.utils.data.Dataset):
    """Map-style dataset over planned batches: DataLoader(BatchDataset(data, refs), batch_size=None, num_workers=n)."""

    def __init__(self, data: TrainingData, refs: list[BatchRef]):
        self.data = data
        self.refs = refs

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int) -> dict:
        return self.data.load_batch(self.refs[i])


class PlannedBatches(torch.utils.data.Dataset):
    """Loads the BatchRef it is indexed with, so one DataLoader (and, with persistent workers, one set of
    worker processes) serves every epoch: the `EpochSampler` hands it each epoch's refs."""

    def __init__(self, data: TrainingData):
        self.data = data

    def __getitem__(self, ref: BatchRef) -> dict:
        return self.data.load_batch(ref)


class EpochSampler(torch.utils.data.Sampler):
    """Yields the refs of the current epoch; the loop sets `refs` before iterating the loader."""

    def __init__(self):
        self.refs: list[BatchRef] = []

    def __iter__(self):
        return iter(list(self.refs))

    def __len__(self) -> int:
        return len(self.refs)


def build_training_data(opts: DataOptions, family: DataFamilyInfo) -> TrainingData:
    """Discover, scan, split, bucket and validate every dataset; raise DataError/ConfigError listing all problems."""
    return build(opts, family, TrainingData)
