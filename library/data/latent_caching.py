"""Latent caching orchestration: find what is missing or stale, decode in parallel, encode by bucket, store.

Images decode in DataLoader workers while the VAE encodes the previous batch.
A batch holds only images of one bucket. Entries are kept in memory always and
written to disk (sd-scripts file names, atomically) when asked; a disk entry
is reused only when latent_cache.load_latent_cache finds it valid for the
exact settings (bucket, crop, flip, alpha mask, VAE, shape, how the posterior
sample was drawn), else rebuilt. The encode function draws each image's
posterior sample from that image's own seed (library/objectives/posterior.py),
so an entry is the same whichever process encodes it, in whatever batch.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from tqdm import tqdm

from library.data.batching import Placement
from library.data.cache_share import CacheShare
from library.data.control_images import control_signature, load_control
from library.data.images import ImageDecodeError, crop_ltrb_for, to_tensor
from library.data.latent_cache import (
    CacheSettings,
    LatentCacheEntry,
    disk_cache_path,
    latent_key_suffix,
    load_latent_cache,
    save_latent_cache,
)
from library.data.loading import load_and_crop
from library.data.mask_sources import mask_signature
from library.data.plan import DatasetPlan
from library.objectives.posterior import POSTERIOR_DRAW

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheJob:
    sample: int
    group: int
    placement: Placement
    settings: CacheSettings
    disk_path: Optional[str]
    key_suffix: str = ""


def plan_cache_jobs(data: DatasetPlan, vae_id: str, to_disk: bool) -> tuple[list[CacheJob], int]:
    """Jobs for entries not valid in memory or on disk (valid disk entries are loaded); also the stale count."""
    f, channels = data.family.vae_scale_factor, data.family.latent_channels
    jobs, stale = [], 0
    for gid, group in enumerate(data.groups):
        ds = data.datasets[group.dataset]
        # Several resolutions of one image need several files (named apart by resolution), unless
        # the family's keys carry the latent size (then they share one file, as in sd-scripts).
        stride = data.family.latent_cache_key_stride
        arch = data.family.latent_cache_arch
        if len(ds.resolutions) > 1 and stride is None:
            arch += f"_{group.resolution[0]}x{group.resolution[1]}"
        for sid, place in group.placements.items():
            sample, sub = data.samples[sid], data.subsets[data.samples[sid].subset]
            bw, bh = place.bucket
            settings = CacheSettings(bucket_reso=place.bucket, crop_ltrb=crop_ltrb_for(place.bucket, sample.size),
                                     flip_aug=sub.flip_aug, alpha_mask=sub.alpha_mask or sample.mask_path is not None,
                                     vae_id=vae_id, latent_shape=(channels, bh // f, bw // f),
                                     mask_source=mask_signature(sample.mask_path, sub.alpha_mask),
                                     posterior=POSTERIOR_DRAW, control_source=control_signature(sample.control_paths))
            key = (sid, gid)
            if key in data.latents and data.latent_signatures.get(key) == settings.signature():
                continue
            path = disk_cache_path(sample.path, sample.size, arch) if to_disk else None
            suffix = latent_key_suffix(place.bucket, stride)
            if path is not None:
                entry = load_latent_cache(path, settings, accept_foreign=data.opts.skip_cache_check, key_suffix=suffix)
                if entry is not None:
                    data.latents[key] = entry
                    data.latent_signatures[key] = settings.signature()
                    continue
                stale += os.path.exists(path)
            jobs.append(CacheJob(sid, gid, place, settings, path, suffix))
    # Largest buckets first, so an out-of-memory error shows at once rather than at the end.
    jobs.sort(key=lambda j: (-j.placement.bucket[0] * j.placement.bucket[1], j.placement.bucket, j.group, j.sample))
    return jobs, stale


def batch_jobs(jobs: list[CacheJob], batch_size: int) -> list[list[CacheJob]]:
    """Chunks of at most batch_size jobs, each chunk within one (group, bucket)."""
    out: list[list[CacheJob]] = []
    for job in jobs:
        last = out[-1] if out else None
        if last and len(last) < batch_size and (last[0].group, last[0].placement.bucket) == (job.group, job.placement.bucket):
            last.append(job)
        else:
            out.append([job])
    return out


class _DecodeBatches(torch.utils.data.Dataset):
    """Decodes and crops the images of one job batch (centre crop, no augmentation)."""

    def __init__(self, data: DatasetPlan, batches: list[list[CacheJob]]):
        self.data, self.batches = data, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        ok, images, alphas, crops, failed, controls = [], [], [], [], [], []
        for j, job in enumerate(self.batches[i]):
            sample = self.data.samples[job.sample]
            sub = self.data.subsets[sample.subset]
            try:
                loaded = load_and_crop(sample, sub, job.placement, self.data.bucketing(self.data.groups[job.group]),
                                       random.Random(0), augment=False, with_conditioning=False)
                controls.append([to_tensor(load_control(c, job.placement.bucket, False, sub.resize_interpolation))
                                 for c in sample.control_paths])
            except ImageDecodeError as e:
                failed.append((sample.path, str(e)))
                continue
            ok.append(j)
            images.append(to_tensor(loaded.image))
            alphas.append(loaded.mask)  # any mask source; stored under sd-scripts' alpha_mask key
            crops.append(loaded.crop_ltrb)
        # controls: one (B, 3, H, W) batch per control index (every image of a subset has as many)
        stacked = [torch.stack(c) for c in zip(*controls)] if controls and controls[0] else []
        return {"batch": i, "ok": ok, "images": torch.stack(images) if images else None,
                "alphas": alphas, "crops": crops, "failed": failed, "controls": stacked}


def _check_shape(latents: torch.Tensor, n: int, expected: tuple[int, int, int]) -> None:
    if tuple(latents.shape) != (n, *expected):
        raise ValueError(f"encode returned latents of shape {tuple(latents.shape)}, expected {(n, *expected)}")


def cache_all_latents(data: DatasetPlan, encode: Callable[[torch.Tensor], torch.Tensor], vae_id: str,
                      to_disk: bool, batch_size: int, num_workers: int, share: Optional[CacheShare] = None) -> None:
    """See DatasetPlan.cache_latents. With `share`, this process encodes every `world`-th job of the plan (the
    plan is the same on every process: `share.planned()` is a barrier between planning and writing) and, in
    memory, `share.gather` brings every process's entries and failures to all."""
    jobs, stale = plan_cache_jobs(data, vae_id, to_disk)
    if stale:
        logger.info("%d latent cache files are stale (other settings, VAE or shape) and will be rebuilt", stale)
    if share is not None:
        share.planned()
        jobs = jobs[share.rank::share.world]
    _encode_jobs(data, jobs, stale, encode, batch_size, num_workers)
    if share is not None and share.gather is not None:
        mine = ({k: (data.latents[k], data.latent_signatures[k]) for k in
                 ((j.sample, j.group) for j in jobs) if k in data.latents}, set(data.bad_paths))
        for entries, bad in share.gather(mine):
            for key, (entry, signature) in entries.items():
                data.latents[key] = entry
                data.latent_signatures[key] = signature
            data.bad_paths.update(bad)


def _encode_jobs(data: DatasetPlan, jobs: list[CacheJob], stale: int, encode: Callable[[torch.Tensor], torch.Tensor],
                 batch_size: int, num_workers: int) -> None:
    if not jobs:
        logger.info("all latents are cached already")
        return
    batches = batch_jobs(jobs, max(1, batch_size))
    loader = torch.utils.data.DataLoader(_DecodeBatches(data, batches), batch_size=None, num_workers=num_workers)
    for item in tqdm(loader, total=len(batches), desc="caching latents", unit="batch"):
        for path, reason in item["failed"]:
            logger.warning("skipping %s", reason)
            data.bad_paths.add(path)
        if item["images"] is None:
            continue
        done = [batches[item["batch"]][j] for j in item["ok"]]
        expected = done[0].settings.latent_shape
        with torch.no_grad():
            latents = encode(item["images"]).detach().float().cpu()
            _check_shape(latents, len(done), expected)
            flipped = None
            if done[0].settings.flip_aug:
                flipped = encode(torch.flip(item["images"], dims=[3])).detach().float().cpu()
                _check_shape(flipped, len(done), expected)
            controls = [encode(c).detach().float().cpu() for c in item["controls"]]
            controls_flipped = [encode(torch.flip(c, dims=[3])).detach().float().cpu() for c in item["controls"]] \
                if done[0].settings.flip_aug else []
        for k, job in enumerate(done):
            alpha = item["alphas"][k]
            entry = LatentCacheEntry(latents=latents[k].clone(), original_size=data.samples[job.sample].size,
                                     crop_ltrb=tuple(item["crops"][k]),
                                     latents_flipped=flipped[k].clone() if flipped is not None else None,
                                     alpha_mask=np.asarray(alpha, dtype=np.float32) if alpha is not None else None,
                                     control_latents=tuple(c[k].clone() for c in controls),
                                     control_latents_flipped=tuple(c[k].clone() for c in controls_flipped))
            data.latents[(job.sample, job.group)] = entry
            data.latent_signatures[(job.sample, job.group)] = job.settings.signature()
            if job.disk_path:
                save_latent_cache(job.disk_path, entry.latents, entry.original_size, entry.crop_ltrb, job.settings,
                                  entry.latents_flipped, entry.alpha_mask, key_suffix=job.key_suffix,
                                  control_latents=entry.control_latents,
                                  control_latents_flipped=entry.control_latents_flipped)
    logger.info("cached latents of %d images%s", len(jobs), f" ({stale} rebuilt)" if stale else "")
