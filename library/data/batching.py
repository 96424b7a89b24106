"""Planning batches: samples, per-resolution bucket groups, epoch order, the progressive schedule.

Everything here is plain data and pure functions of (seed, epoch, step), so a
resumed run plans exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass, field
from typing import Optional

Size = tuple[int, int]


@dataclass
class Sample:
    """One image of the dataset (train, reg or validation)."""

    id: int
    path: str
    caption: str  # raw caption; the pipeline runs per sample at load time
    dataset: int
    subset: int  # index into TrainingData.subsets
    size: Size  # original (width, height)
    num_repeats: int = 1
    is_reg: bool = False
    is_validation: bool = False
    loss_weight: float = 1.0
    mask_path: Optional[str] = None
    conditioning_path: Optional[str] = None  # the control scripts' conditioning image (cropped/flipped with it)
    train_resolution: Optional[Size] = None  # the bucket a fine-tune metadata file fixed for it
    control_paths: tuple[str, ...] = ()  # edit training: its control image(s) (library/data/control_images.py)


@dataclass
class Placement:
    bucket: Size  # (width, height) after crop
    resized: Size  # size the image is resized to before cropping


@dataclass
class Group:
    """The samples of one dataset at one resolution, bucketed; batches never leave a group's bucket."""

    dataset: int
    resolution: Size
    batch_size: int
    validation: bool = False
    buckets: dict[Size, list[int]] = field(default_factory=dict)  # bucket -> sample ids, once per repeat
    placements: dict[int, Placement] = field(default_factory=dict)
    bucket_info: dict = field(default_factory=dict)

    def num_batches(self) -> int:
        return sum(-(-len(ids) // self.batch_size) for ids in self.buckets.values())


@dataclass(frozen=True)
class BatchRef:
    """A planned batch; cheap and picklable. `samples` are sample ids, all in bucket `bucket` of group `group`."""

    epoch: int
    index: int  # position in the epoch
    step: int  # global optimizer step at which it is consumed
    group: int
    bucket: Size
    samples: tuple[int, ...]
    validation: bool = False
    offset: int = 0  # data parallel: position of samples[0] in the batch of all processes (see plan_epoch)


def sample_noise_seed(seed: int, epoch: int, index: int, position: int) -> int:
    """The seed of one training sample's noise and timestep: a function of these numbers only, so the same sample
    gets the same noise whatever the number of processes, the batch it shares or a resume."""
    digest = hashlib.sha256(f"noise/{seed}/{epoch}/{index}/{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_rng(seed: int, epoch: int, index: int, position: int, validation: bool = False) -> random.Random:
    """The RNG of one sample in one batch: depends only on these numbers (not on workers or resume)."""
    # A string seed is hashed with SHA-512 by random.Random, independent of PYTHONHASHSEED.
    return random.Random(f"{'val' if validation else 'train'}/{seed}/{epoch}/{index}/{position}")


def balance_reg_repeats(num_train_images: int, reg_repeats: list[int]) -> list[int]:
    """Repeats for each reg image so reg images match the train count (with repeats), as sd-scripts.

    First pass: each reg image with its subset's repeats until the count is reached (later
    images get 0); further passes add one repeat per image round-robin.
    """
    out = [0] * len(reg_repeats)
    if not reg_repeats:
        return out
    n, first = 0, True
    while n < num_train_images:
        for i, repeats in enumerate(reg_repeats):
            if first:
                out[i] = repeats
                n += repeats
            else:
                out[i] += 1
                n += 1
            if n >= num_train_images:
                break
        first = False
    return out


def chunk_group(group: Group, rng: Optional[random.Random], processes: int = 1) -> list[tuple[Size, tuple[int, ...]]]:
    """(bucket, sample ids) batches of a group; each bucket shuffled by `rng` first (None: keep order).
    `processes`: batches of batch_size x processes (one per optimizer micro-step of all processes)."""
    out = []
    size = group.batch_size * processes
    for bucket in sorted(group.buckets):
        ids = list(group.buckets[bucket])
        if rng is not None:
            rng.shuffle(ids)
        for start in range(0, len(ids), size):
            out.append((bucket, tuple(ids[start:start + size])))
    return out


def process_batches(group: Group, processes: int) -> int:
    """Batches of the group each of `processes` processes takes per epoch (see plan_epoch)."""
    if processes == 1:
        return group.num_batches()
    size = group.batch_size * processes
    return sum(len(ids) // size + (len(ids) % size >= processes) for ids in group.buckets.values())


def split_batch(ids: tuple[int, ...], processes: int, rank: int) -> tuple[int, tuple[int, ...]]:
    """(offset, ids) of process `rank`'s contiguous part of a batch of all processes (sizes differ by 1 at most)."""
    q, r = divmod(len(ids), processes)
    start = rank * q + min(rank, r)
    return start, ids[start:start + q + (rank < r)]


@dataclass
class ResolutionSchedule:
    """Which resolution of each progressive dataset is active at a step: fractions of max_train_steps, low -> high."""

    boundaries: dict[int, list[int]] = field(default_factory=dict)  # dataset -> end step of each phase

    @classmethod
    def build(cls, fractions_by_dataset: dict[int, list[float]], max_train_steps: int) -> "ResolutionSchedule":
        boundaries = {}
        for ds, fractions in fractions_by_dataset.items():
            ends, total = [], 0.0
            for f in fractions:
                total += f
                ends.append(round(total * max_train_steps))
            ends[-1] = max_train_steps
            boundaries[ds] = ends
        return cls(boundaries)

    def resolution_index(self, dataset: int, step: int) -> Optional[int]:
        """Index of the active resolution, or None when the dataset trains all resolutions."""
        ends = self.boundaries.get(dataset)
        if ends is None:
            return None
        return min(bisect.bisect_right(ends, step), len(ends) - 1)

    def next_boundary(self, step: int) -> Optional[int]:
        """The first phase change after `step` (over all datasets), or None."""
        later = [e for ends in self.boundaries.values() for e in ends[:-1] if e > step]
        return min(later) if later else None


def active_groups(groups: list[Group], resolution_ids: list[int], schedule: ResolutionSchedule, step: int) -> list[int]:
    """Training group ids active at `step` (resolution_ids[g] = index of g's resolution in its dataset)."""
    out = []
    for gid, group in enumerate(groups):
        if group.validation:
            continue
        wanted = schedule.resolution_index(group.dataset, step)
        if wanted is None or wanted == resolution_ids[gid]:
            out.append(gid)
    return out


def plan_epoch(groups: list[Group], group_ids: list[int], seed: int, epoch: int, start_step: int,
               grad_accum: int, limit: Optional[int], rank: int = 0, world_size: int = 1,
               keep_bucket_order: bool = False) -> list[BatchRef]:
    """The batches of one epoch: buckets shuffled, batches formed, then the batch order shuffled (seed + epoch).
    With `keep_bucket_order` (--keep_bucket_order) each bucket keeps its dataset order; only the batch order is
    shuffled.

    With `world_size` processes the batches are formed of batch_size x N samples of one bucket (the batch of one
    micro-step of all processes), the same on every process (a function of seed and epoch only), and process
    `rank` takes its contiguous part of each: so 2 processes x batch 1 see the samples, in the same places, that 1
    process x batch 2 does. A batch of fewer than N samples (the end of a bucket) is dropped, so every process
    takes the same number of steps. `limit` counts batches of all processes. `index` is the batch's position in
    the epoch and `offset` its part's position in it (per-sample randomness); `step` is the global optimizer step
    it is consumed at.
    """
    world_size = max(1, world_size)
    rng = random.Random(seed + epoch)
    inside = None if keep_bucket_order else rng
    planned = [(gid, bucket, ids) for gid in group_ids for bucket, ids in chunk_group(groups[gid], inside, world_size)]
    rng.shuffle(planned)
    if world_size > 1:
        planned = [p for p in planned if len(p[2]) >= world_size]
    if limit is not None:
        planned = planned[:limit]
    refs = []
    for i, (gid, bucket, ids) in enumerate(planned):
        offset, mine = split_batch(ids, world_size, rank) if world_size > 1 else (0, ids)
        refs.append(BatchRef(epoch=epoch, index=i, step=start_step + i // grad_accum, group=gid, bucket=bucket,
                             samples=mine, offset=offset))
    return refs
