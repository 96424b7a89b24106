"""Latent caching as sd-scripts users expect it: flags that imply others, cache keys that follow the weights."""

from __future__ import annotations

import copy
import glob
import os

import torch

from library.data.te_cache import cache_source_id
from tests.train_helpers import base_args, make_dataset, make_trainer


def _npz(data):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(data, "*", "*.npz")))


def _count_encodes(trainer, monkeypatch) -> list:
    encoded = []
    original = trainer.family.encode_images
    monkeypatch.setattr(trainer.family, "encode_images", lambda vae, x, *more: encoded.append(len(x)) or original(vae, x, *more))
    return encoded


def test_cache_latents_to_disk_alone_implies_cache_latents(tmp_path):
    """--cache_latents_to_disk alone caches the latents: sd-scripts implies --cache_latents from it."""
    data = make_dataset(str(tmp_path), n=2)
    args = base_args(data, str(tmp_path / "out"), steps=1, extra=["--cache_latents_to_disk"])
    trainer = make_trainer(args)
    assert trainer.s.data.cache_latents and trainer.s.data.cache_latents_to_disk
    trainer.cache_latents_only()
    assert _npz(data) == ["img0_0064x0064_sd.npz", "img1_0128x0064_sd.npz"]


def test_changed_vae_at_the_same_path_rebuilds_the_latent_cache(tmp_path, monkeypatch, tiny_sd1):
    """The latent cache is keyed on the VAE's weights, not its path: a VAE replaced at the same path (different
    weights) rebuilds it; the same weights reuse it."""
    vae_dir = str(tmp_path / "vae")
    vae = copy.deepcopy(tiny_sd1.vae)
    vae.save_pretrained(vae_dir)
    data = make_dataset(str(tmp_path), n=2)
    args = base_args(data, str(tmp_path / "out"), steps=1,
                     extra=["--cache_latents", "--cache_latents_to_disk", "--vae", vae_dir])

    def cache_run() -> list:
        trainer = make_trainer(args)
        encoded = _count_encodes(trainer, monkeypatch)
        trainer.cache_latents_only()
        return encoded

    assert sum(cache_run()) == 2  # first run: both images encoded
    assert cache_run() == []  # same weights: every entry reused
    with torch.no_grad():
        for p in vae.encoder.parameters():
            p.add_(0.01)
    vae.save_pretrained(vae_dir)  # another VAE at the same path
    assert sum(cache_run()) == 2  # stale latents are not reused
    assert cache_run() == []


def test_cache_source_id_follows_the_weights_not_the_path(tiny_sd1):
    """In-memory presets and files alike are named by their weights' content hash."""
    vae = tiny_sd1.vae
    a = cache_source_id("tiny:sd1", vae.dtype, {}, weights=vae)
    b = cache_source_id("/somewhere/else.safetensors", vae.dtype, {}, weights=copy.deepcopy(vae))
    assert a == b and a.startswith("sha256:")
    changed = copy.deepcopy(vae)
    with torch.no_grad():
        next(changed.parameters()).view(-1)[0] += 1
    assert cache_source_id("tiny:sd1", vae.dtype, {}, weights=changed) != a
    assert cache_source_id("tiny:sd1", vae.dtype, {"x": 1}, weights=vae) != a
