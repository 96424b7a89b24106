"""Building the text-encoder output cache with several processes: each encodes its share, all hold every output.

Two threads stand in for two processes: `planned` is a barrier and `gather` an exchange, as the loop builds them
from torch.distributed (library/train/trainer.py _cache_share); the 2-process latent case runs under torchrun in
tests/test_distributed.py.
"""

from __future__ import annotations

import os
import threading

import torch

from library.data.cache_share import CacheShare
from library.data.te_cache import build_text_cache


def _encoder(log: list):
    def encode(captions):
        log.extend(c for c in captions if c)  # the probe encodes ""
        return {"hidden": torch.stack([torch.full((2, 3), float(len(c))) for c in captions])}
    return encode


def test_two_processes_split_the_captions_and_both_hold_all(tmp_path):
    items = []
    for i in range(7):
        path = str(tmp_path / f"img{i}.png")
        open(path, "wb").close()
        items.append((path, f"caption number {i}" + "!" * i))
    barrier = threading.Barrier(2)
    slots: list = [None, None]

    def gather(obj, rank):
        slots[rank] = obj
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    logs, caches = [[], []], [None, None]

    def run(rank: int) -> None:
        share = CacheShare(rank, 2, barrier.wait, lambda obj: gather(obj, rank))
        caches[rank] = build_text_cache(items, _encoder(logs[rank]), model_id="m", max_token_length=None,
                                        suffix="_te.npz", to_disk=True, share=share)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    captions = [c for _, c in items]
    assert sorted(logs[0] + logs[1]) == sorted(captions) and not set(logs[0]) & set(logs[1])
    assert len(logs[0]) == 4 and len(logs[1]) == 3  # every second caption left to encode
    for cache in caches:
        assert sorted(cache) == sorted(captions)
        assert all(torch.equal(cache[c]["hidden"], torch.full((2, 3), float(len(c)))) for c in captions)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith("_te.npz"))
    assert files == sorted(f"img{i}_te.npz" for i in range(7))
    # a second build (one process) finds every file valid: nothing is encoded again
    again: list = []
    build_text_cache(items, _encoder(again), model_id="m", max_token_length=None, suffix="_te.npz", to_disk=True)
    assert again == []
