"""Masked training (OneTrainer-style): -masklabel.png masks, unmasked weight / probability, normalisation, caching."""

import os
import signal

import numpy as np
import pytest
import torch
from PIL import Image

from library.core.errors import DataError
from library.data import DataFamilyInfo, build_training_data
from library.data.options import DataOptions
from library.objectives.losses import LossOptions, mask_weights, training_loss
from library.train.trainer import InterruptedTraining
from tests.train_helpers import base_args, make_dataset, make_trainer

FAMILY = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8, latent_channels=4)


class _Scheme:  # DDPM-like stand-in; the SNR terms are off
    prediction_type = "epsilon"
    has_snr = True


def _loss(pred, target, mask, **kw):
    t = torch.zeros(pred.shape[0], dtype=torch.long)
    return training_loss(pred, target, t, _Scheme(), LossOptions(), mask=mask, **kw)


# --- the loss --------------------------------------------------------------------------------------------


def test_zero_unmasked_weight_gives_exactly_zero_gradient_outside_the_mask():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(2, 4, 8, 8, generator=g, requires_grad=True)
    target = torch.randn(2, 4, 8, 8, generator=g)
    mask = torch.zeros(2, 1, 64, 64)
    mask[:, :, 16:40, 8:32] = 1.0  # latent cells 2..4 x 1..3 (8-pixel blocks, area resize is exact)
    loss, _ = _loss(pred, target, mask, unmasked_weight=0.0)
    loss.backward()
    inside = torch.zeros(8, 8, dtype=torch.bool)
    inside[2:5, 1:4] = True
    assert torch.all(pred.grad[:, :, ~inside] == 0)
    assert torch.all(pred.grad[:, :, inside] != 0)


def test_unmasked_weight_weights_outside_and_normalize_divides_by_mean():
    pred, target = torch.ones(1, 1, 4, 4), torch.zeros(1, 1, 4, 4)  # l2 = 1 everywhere
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., :2, :] = 1.0  # half the area
    assert _loss(pred, target, mask)[0].item() == 0.5  # sd-scripts: weight 0 outside
    assert _loss(pred, target, mask, unmasked_weight=0.1)[0].item() == pytest.approx(0.55, abs=1e-7)
    # Normalised: mean of w / mean(w) is exactly 1 for any mask and weight.
    assert _loss(pred, target, mask, normalize_masked_area=True)[0].item() == 1.0
    assert _loss(pred, target, mask, unmasked_weight=0.1, normalize_masked_area=True)[0].item() == pytest.approx(1.0)
    small = torch.zeros(1, 1, 4, 4)
    small[..., 0, 0] = 1.0
    w = mask_weights(small, (4, 4), 0.0, True)
    assert w[0, 0, 0, 0].item() == 16.0 and w.sum().item() == 16.0  # 1 / (1/16) inside, 0 outside
    # Per-sample settings; an all-zero mask stays 0 (no division by zero).
    two = torch.stack([mask[0], torch.zeros(1, 4, 4)])
    _, per = _loss(pred.expand(2, -1, -1, -1), target.expand(2, -1, -1, -1), two,
                   unmasked_weight=torch.tensor([0.0, 0.0]), normalize_masked_area=torch.tensor([True, True]))
    assert per.tolist() == [1.0, 0.0]


def test_unmasked_weight_one_equals_no_mask():
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    mask = (torch.rand(2, 1, 64, 64, generator=g) > 0.5).float()
    assert torch.equal(_loss(pred, target, mask, unmasked_weight=1.0)[1], _loss(pred, target, None)[1])


# --- settings ------------------------------------------------------------------------------------------------


def test_mask_keys_at_every_toml_level_and_as_flags(tmp_path):
    from library.core.errors import ConfigError
    from library.data.config import resolve_datasets

    toml = tmp_path / "d.toml"
    toml.write_text('[general]\nunmasked_weight = 0.1\nmasked_loss = true\n'
                    '[[datasets]]\nresolution = 64\nunmasked_probability = 0.2\n'
                    '[[datasets.subsets]]\nimage_dir = "a"\nnormalize_masked_area_loss = true\n'
                    '[[datasets.subsets]]\nimage_dir = "b"\nunmasked_weight = 0.5\nmasked_loss = false\n')
    a, b = resolve_datasets(DataOptions(dataset_config=str(toml), unmasked_probability=0.9)).datasets[0].subsets
    assert (a.masked_loss, a.unmasked_probability, a.unmasked_weight, a.normalize_masked_area_loss) == (True, 0.2, 0.1, True)
    assert (b.masked_loss, b.unmasked_probability, b.unmasked_weight, b.normalize_masked_area_loss) == (False, 0.2, 0.5, False)
    # Flags are the layer below the TOML.
    os.makedirs(tmp_path / "train" / "1_x")
    [sub] = resolve_datasets(DataOptions(train_data_dir=str(tmp_path / "train"), resolution="64", masked_loss=True,
                                         unmasked_weight=0.3)).datasets[0].subsets
    assert (sub.masked_loss, sub.unmasked_weight, sub.unmasked_probability) == (True, 0.3, 0.0)
    with pytest.raises(ConfigError, match=r"^--unmasked_weight: expected a number from 0 to 1, got 1.5$"):
        resolve_datasets(DataOptions(dataset_config=str(toml), unmasked_weight=1.5))
    toml.write_text('[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "a"\nunmasked_probability = 2\n')
    with pytest.raises(ConfigError, match=r"subsets\[0\]\.unmasked_probability: expected a number from 0 to 1, got 2$"):
        resolve_datasets(DataOptions(dataset_config=str(toml)))


# --- masklabel files through the data pipeline ---------------------------------------------------------


def _pattern_image(w, h):
    """An image whose left third is red, with a white square; its masklabel marks exactly the square."""
    img = np.zeros((h, w, 3), np.uint8)
    img[:, : w // 3] = (255, 0, 0)
    img[h // 4: h // 2, w // 8: w // 2] = 255
    mask = np.zeros((h, w), np.uint8)
    mask[h // 4: h // 2, w // 8: w // 2] = 255
    return img, mask


def _masklabel_folder(root, sizes=((128, 64), (64, 128)), with_mask=(True, True)):
    folder = os.path.join(root, "train", "2_toy")
    os.makedirs(folder, exist_ok=True)
    for i, ((w, h), has) in enumerate(zip(sizes, with_mask)):
        img, mask = _pattern_image(w, h)
        Image.fromarray(img).save(os.path.join(folder, f"im{i}.png"))
        if has:
            Image.fromarray(mask, mode="L").save(os.path.join(folder, f"im{i}-masklabel.png"))
        with open(os.path.join(folder, f"im{i}.txt"), "w") as f:
            f.write(f"toy {i}")
    return os.path.join(root, "train")


def _opts(train, **kw):
    base = dict(train_data_dir=train, resolution="64", enable_bucket=True, min_bucket_reso=64, max_bucket_reso=128,
                caption_extension=".txt", seed=3, masked_loss=True, flip_aug=True,
                train_batch_size=1)
    base.update(kw)
    return DataOptions(**base)


def _batches(data, epochs=3):
    data.plan(100, 1)
    for epoch in range(1, epochs + 1):
        for ref in data.epoch_batches(epoch, 0):
            yield ref, data.load_batch(ref)


def test_masklabel_files_are_masks_cropped_and_flipped_like_the_image(tmp_path):
    # At resolution 64 both go to the 64x64 bucket: the centre 64 of 150 pixels is cropped out.
    train = _masklabel_folder(str(tmp_path), sizes=((150, 64), (64, 150)))
    data = build_training_data(_opts(train), FAMILY)
    assert sorted(os.path.basename(s.path) for s in data.samples) == ["im0.png", "im1.png"]  # masks are not images
    assert all(s.mask_path and s.mask_path.endswith("-masklabel.png") for s in data.samples)
    seen_flip = {False: 0, True: 0}
    for ref, batch in _batches(data):
        image, mask = batch["images"][0], batch["masks"][0, 0]
        white = (image > 0.99).all(dim=0).float()  # the white square, wherever crop and flip put it
        assert torch.equal((mask > 0.5).float(), white)
        left_red = image[0, :, 0].mean() > 0.9 and image[1, :, 0].mean() < -0.9
        seen_flip[not bool(left_red)] += 1
    assert seen_flip[False] and seen_flip[True]  # both orientations were checked


def test_unmasked_probability_one_is_no_mask_and_zero_is_the_mask(tmp_path):
    train = _masklabel_folder(str(tmp_path))
    for p in (0.0, 1.0):
        data = build_training_data(_opts(train, unmasked_probability=p, flip_aug=False), FAMILY)
        for _, batch in _batches(data, 1):
            m = batch["masks"][0, 0]
            if p == 1.0:
                assert torch.equal(m, torch.ones_like(m))
            else:
                assert 0 < float(m.mean()) < 1 and set(torch.unique(m).tolist()) <= {0.0, 1.0}
    # In between: some samples drop their mask, deterministically for a (seed, epoch, batch, position).
    data = build_training_data(_opts(train, unmasked_probability=0.5, flip_aug=False), FAMILY)
    full = [bool((b["masks"] == 1).all()) for _, b in _batches(data, 5)]
    again = [bool((b["masks"] == 1).all()) for _, b in _batches(data, 5)]
    assert full == again and any(full) and not all(full)


def test_mask_settings_per_subset_reach_the_batch(tmp_path):
    train = _masklabel_folder(str(tmp_path))
    data = build_training_data(_opts(train, unmasked_weight=0.25, normalize_masked_area_loss=True), FAMILY)
    _, batch = next(_batches(data, 1))
    assert batch["mask_unmasked_weights"].tolist() == [0.25] and batch["mask_normalize"].tolist() == [True]


def test_masked_loss_without_any_mask_source_is_reported(tmp_path):
    train = _masklabel_folder(str(tmp_path), with_mask=(False, False))
    with pytest.raises(DataError) as e:
        build_training_data(_opts(train), FAMILY)
    assert str(e.value) == ("--train_data_dir 2_toy: masked_loss needs masks: alpha_mask = true, conditioning_data_dir, "
                            "or <image stem>-masklabel.png files beside the images")
    # Without masked_loss the masklabel files are still not training images, and no mask is loaded.
    train = _masklabel_folder(str(tmp_path / "b"))
    data = build_training_data(_opts(train, masked_loss=False), FAMILY)
    assert len(data.samples) == 2 and all(s.mask_path is None for s in data.samples)


def test_masklabel_masks_are_cached_with_the_latents(tmp_path):
    train = _masklabel_folder(str(tmp_path))
    data = build_training_data(_opts(train, flip_aug=False), FAMILY)
    data.plan(100, 1)
    encode = lambda x: torch.nn.functional.avg_pool2d(x, 8).repeat(1, 2, 1, 1)[:, :4]  # noqa: E731
    live = {os.path.basename(b["image_paths"][0]): b["masks"] for _, b in _batches(data, 1)}
    data.cache_latents(encode, "fake-vae", to_disk=True, batch_size=1, num_workers=0)
    files = sorted(n for n in os.listdir(os.path.join(train, "2_toy")) if n.endswith(".npz"))
    assert files == ["im0_0128x0064_sd.npz", "im1_0064x0128_sd.npz"]
    with np.load(os.path.join(train, "2_toy", files[0])) as npz:
        assert npz["alpha_mask"].shape == (64, 64) and 0 < npz["alpha_mask"].mean() < 1
    cached = {os.path.basename(b["image_paths"][0]): b["masks"] for _, b in _batches(data, 1)}
    assert all(torch.equal(live[k], cached[k]) for k in live)
    # A second run reuses the files; changing the mask file makes them stale.
    data2 = build_training_data(_opts(train, flip_aug=False), FAMILY)
    data2.plan(100, 1)
    calls = []
    data2.cache_latents(lambda x: calls.append(1) or encode(x), "fake-vae", True, 1, 0)
    assert calls == []
    mask_file = os.path.join(train, "2_toy", "im0-masklabel.png")
    Image.fromarray(np.full((64, 128), 255, np.uint8), mode="L").save(mask_file)
    os.utime(mask_file, ns=(1, 1))
    data3 = build_training_data(_opts(train, flip_aug=False), FAMILY)
    data3.plan(100, 1)
    data3.cache_latents(lambda x: calls.append(1) or encode(x), "fake-vae", True, 1, 0)
    assert calls == [1]


def _masklabel_dataset(root, n=2):
    data = make_dataset(root, n=n)
    folder = os.path.join(data, "5_sks toy")
    for i in range(n):
        w, h = Image.open(os.path.join(folder, f"img{i}.png")).size
        mask = np.zeros((h, w), np.uint8)
        mask[h // 4: h // 2, w // 4: w // 2] = 255
        Image.fromarray(mask, mode="L").save(os.path.join(folder, f"img{i}-masklabel.png"))
    return data


def test_one_training_step_with_masklabel_files(tmp_path):
    data = _masklabel_dataset(str(tmp_path))
    out = str(tmp_path / "out")
    trainer = make_trainer(base_args(data, out, steps=1, extra=[
        "--masked_loss", "--unmasked_weight", "0.1", "--unmasked_probability", "0.2", "--normalize_masked_area_loss"]))
    assert trainer.run() == os.path.join(out, "lora.safetensors")
    assert all(s.mask_path for s in trainer.data.samples) and len(trainer.data.samples) == 2
    batch = trainer.data.load_batch(trainer.data.epoch_batches(1, 0)[0])
    assert batch["masks"] is not None and batch["mask_unmasked_weights"].tolist() == [pytest.approx(0.1)]
    assert batch["mask_normalize"].tolist() == [True]


def test_resume_with_unmasked_probability_is_bitwise(tmp_path):
    from safetensors.torch import load_file

    data = _masklabel_dataset(str(tmp_path))  # 2 images x 5 repeats
    extra = ["--masked_loss", "--unmasked_probability", "0.5", "--unmasked_weight", "0.1", "--flip_aug"]
    straight = make_trainer(base_args(data, str(tmp_path / "a"), steps=6, extra=extra)).run()
    out_b = str(tmp_path / "b")
    first = make_trainer(base_args(data, out_b, steps=6, extra=extra))

    def stop(trainer, event, step):
        if event == "step" and step == 3:
            trainer._on_signal(signal.SIGTERM, None)
    first.s.hooks.append(stop)
    with pytest.raises(InterruptedTraining):
        first.run()
    resumed = make_trainer(base_args(data, out_b, steps=6, extra=extra + ["--resume", "auto"])).run()
    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
