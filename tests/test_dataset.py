"""TrainingData: discovery to batches, validation, bad-data reports, loading, latent caching, metadata."""

import json
import os

import pytest
import torch
from PIL import Image

from library.core.errors import DataError
from library.data import (
    BatchDataset,
    DataFamilyInfo,
    build_training_data,
    split_for_validation,
)
from library.data.options import DataOptions

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "train")
FAMILY = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8, latent_channels=4)


def png(path, size=(64, 64), color=(255, 0, 0), mode="RGB"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new(mode, size, color).save(path)
    return str(path)


def folder(tmp_path, name, sizes, caption=None):
    for i, size in enumerate(sizes):
        png(tmp_path / name / f"p{i + 1}.png", size, (30 * i % 255, 100, 200))
        if caption:
            (tmp_path / name / f"p{i + 1}.txt").write_text(f"{caption}, tag{i + 1}")
    return str(tmp_path / name)


def opts(train_dir, **kw):
    base = dict(train_data_dir=str(train_dir), resolution="64", enable_bucket=True, min_bucket_reso=64,
                max_bucket_reso=128, caption_extension=".txt", seed=1)
    base.update(kw)
    return DataOptions(**base)


def fake_encode(calls):
    def encode(images):
        calls.append(images.shape[0])
        return torch.nn.functional.avg_pool2d(images, 8).repeat(1, 2, 1, 1)[:, :4]
    return encode


def test_example_dataset_loads_in_folder_mode():
    data = build_training_data(DataOptions(train_data_dir=EXAMPLES, resolution="128", enable_bucket=True, min_bucket_reso=64,
                                           max_bucket_reso=256, caption_extension=".txt", train_batch_size=2, seed=1), FAMILY)
    assert (data.num_train_images, data.num_reg_images, data.batches_per_epoch()) == (70, 0, 35)
    assert {b: len(ids) for b, ids in data.groups[0].buckets.items()} == {(128, 128): 50, (64, 192): 20}
    assert json.loads(data.metadata()["ss_dataset_dirs"]) == {"10_sks shape": {"n_repeats": 10, "img_count": 7}}


def test_epoch_batches_are_deterministic_pure_and_reshuffled(tmp_path):
    folder(tmp_path, "train/3_sks", [(64, 64)] * 4 + [(128, 64)] * 3, caption="sks")
    data = build_training_data(opts(tmp_path / "train", train_batch_size=2), FAMILY)
    data.plan(100, 2)
    e1 = data.epoch_batches(1, 0)
    assert len(e1) == data.batches_per_epoch() == 6 + 5  # ceil(12/2) + ceil(9/2)
    assert [r.step for r in e1[:5]] == [0, 0, 1, 1, 2]
    for ref in e1:
        assert all(data.groups[ref.group].placements[s].bucket == ref.bucket for s in ref.samples)
    assert sorted(len(r.samples) for r in e1).count(1) == 1  # only the last batch of the odd bucket is short
    assert e1 == data.epoch_batches(1, 0)
    assert e1 != data.epoch_batches(2, 6)
    fresh = build_training_data(opts(tmp_path / "train", train_batch_size=2), FAMILY)
    fresh.plan(100, 2)
    assert fresh.epoch_batches(1, 0) == e1  # a resumed run plans the same batches
    assert fresh.load_batch(e1[3])["captions"] == data.load_batch(e1[3])["captions"]


def test_keep_bucket_order_keeps_each_buckets_dataset_order_and_shuffles_the_batches(tmp_path):
    """--keep_bucket_order (the web UI's "keep order within buckets"): the batches of a bucket hold its samples in
    dataset order (file names sorted, repeats after each other as planned), epoch after epoch; the order in which
    the batches are drawn is still shuffled per epoch. Off, the samples inside a bucket are reshuffled."""
    folder(tmp_path, "train/2_sks", [(64, 64)] * 6 + [(128, 64)] * 4, caption="sks")

    def bucket_orders(data, epoch):
        refs = data.epoch_batches(epoch, 0)
        order = {}
        for ref in sorted(refs, key=lambda r: (r.bucket, r.samples)):
            order.setdefault(ref.bucket, []).extend(ref.samples)
        return order, [r.bucket for r in refs]

    kept = build_training_data(opts(tmp_path / "train", train_batch_size=2, resolution="128", keep_bucket_order=True),
                               FAMILY)
    kept.plan(100, 1)
    planned = {b: list(ids) for b, ids in kept.groups[0].buckets.items()}
    assert sorted(planned) == [(128, 64), (128, 128)]
    for epoch in (1, 2, 3):
        order, _ = bucket_orders(kept, epoch)
        assert order == planned
    assert len({tuple(bucket_orders(kept, e)[1]) for e in (1, 2, 3, 4)}) > 1  # batch order still shuffled
    shuffled = build_training_data(opts(tmp_path / "train", train_batch_size=2, resolution="128"), FAMILY)
    shuffled.plan(100, 1)
    assert any(bucket_orders(shuffled, e)[0] != planned for e in (1, 2, 3))


def test_multi_resolution_trains_every_resolution(tmp_path):
    folder(tmp_path, "train/1_x", [(128, 128)] * 3, caption="x")
    data = build_training_data(opts(tmp_path / "train", resolution="64;128", max_bucket_reso=256), FAMILY)
    data.plan(10, 1)
    assert [g.resolution for g in data.groups] == [(64, 64), (128, 128)]
    assert sorted({r.bucket for r in data.epoch_batches(1, 0)}) == [(64, 64), (128, 128)]
    assert data.batches_per_epoch() == 6


def test_progressive_schedule_switches_resolution_at_the_fraction(tmp_path):
    folder(tmp_path, "train/4_x", [(128, 128)] * 2, caption="x")
    data = build_training_data(opts(tmp_path / "train", resolution="128;64", max_bucket_reso=256,
                                    resolution_schedule="progressive", resolution_step_fractions="0.25,0.75"), FAMILY)
    data.plan(12, 1)
    first = data.epoch_batches(1, 0)
    assert [r.bucket for r in first] == [(64, 64)] * 3  # 12 * 0.25 = 3 steps at 64, then the epoch ends
    second = data.epoch_batches(2, 3)
    assert {r.bucket for r in second} == {(128, 128)} and len(second) == 8 and second[0].step == 3
    assert data.num_epochs() == 3  # 3 steps, 8 steps, 1 step
    assert data.batches_per_epoch() == 8


def test_validation_split_golden():
    train, val = split_for_validation([f"p{i}" for i in range(1, 8)], 0.2, 1234)
    assert (train, val) == (["p2", "p3", "p6", "p5", "p1", "p4"], ["p7"])
    assert split_for_validation(["a", "b"], 0.0, 1) == (["a", "b"], [])


def test_validation_split_in_the_dataset(tmp_path):
    folder(tmp_path, "train/2_x", [(64, 64)] * 7, caption="x")
    data = build_training_data(opts(tmp_path / "train", validation_split=0.2, validation_seed=1234, flip_aug=True), FAMILY)
    assert (data.num_train_images, data.num_validation_images) == (12, 1)
    refs = data.validation_batches()
    assert len(refs) == 1 and refs[0].validation and refs == data.validation_batches()
    batch = data.load_batch(refs[0])
    assert [os.path.basename(p) for p in batch["image_paths"]] == ["p7.png"]
    assert batch["captions"] == ["x, tag7"]


def test_bad_data_report_lists_every_problem(tmp_path, caplog):
    """Unusable image files are skipped and named in one warning; the other problems
    stop the run, all listed."""
    train = folder(tmp_path, "train/2_x", [(64, 64)] * 2, caption="x")
    with open(os.path.join(train, "corrupt.png"), "wb") as f:
        f.write(b"not a png at all")
    open(os.path.join(train, "zero.png"), "wb").close()
    (tmp_path / "train" / "2_x" / "p2.txt").write_text("")
    reg = str(tmp_path / "reg")
    with pytest.raises(DataError) as e:
        build_training_data(opts(tmp_path / "train", reg_data_dir=reg), FAMILY)
    lines = str(e.value).splitlines()
    assert lines[0] == "2 problems in the training data; fix them and start again:"
    assert sorted(line.strip() for line in lines[1:]) == sorted([
        f"--reg_data_dir: no images found in {reg}: the folder does not exist",
        f"{train}/p2.txt: empty caption file (delete it to use the class tokens, or write a caption)",
    ])
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert warnings == ["2 image file(s) skipped, not trained:\n"
                        f"  {train}/corrupt.png: not a recognised image format (unreadable header)\n"
                        f"  {train}/zero.png: empty file (0 bytes)"]


def test_small_images_without_buckets_and_too_few_for_a_batch(tmp_path):
    folder(tmp_path, "train/1_x", [(32, 32), (64, 64)], caption="x")
    with pytest.raises(DataError) as e:
        build_training_data(opts(tmp_path / "train", enable_bucket=False, train_batch_size=4, min_image_side=0), FAMILY)
    assert [line.strip() for line in str(e.value).splitlines()[1:]] == [
        f"{tmp_path}/train/1_x/p1.png: image is 32x32, smaller than the resolution 64x64; enlarge it or set enable_bucket = true",
        "command line: 1 images (with repeats) at 64x64, fewer than one batch (batch_size 4)",
    ]


def test_load_batch_shapes_reg_weight_and_alpha_mask(tmp_path):
    png(tmp_path / "train/1_x/a.png", (64, 128), (255, 0, 0, 128), "RGBA")
    png(tmp_path / "train/1_x/b.png", (64, 128), (0, 255, 0, 255), "RGBA")
    folder(tmp_path, "reg/1_y", [(64, 128)] * 3)
    data = build_training_data(opts(tmp_path / "train", reg_data_dir=str(tmp_path / "reg"), train_batch_size=4,
                                    prior_loss_weight=0.5, alpha_mask=True, masked_loss=True,
                                    enable_bucket=False, resolution="64,128"), FAMILY)
    assert (data.num_train_images, data.num_reg_images) == (2, 2)  # reg balanced to the train count
    data.plan(10, 1)
    [ref] = data.epoch_batches(1, 0)
    batch = data.load_batch(ref)
    assert ref.bucket == (64, 128)
    assert batch["images"].shape == (4, 3, 128, 64) and batch["latents"] is None
    assert -1.0 <= batch["images"].min() and batch["images"].max() <= 1.0
    assert sorted(batch["loss_weights"].tolist()) == [0.5, 0.5, 1.0, 1.0]
    assert batch["masks"].shape == (4, 1, 128, 64)
    weights_by_name = {os.path.basename(p): w for p, w in zip(batch["image_paths"], batch["loss_weights"].tolist())}
    masks_by_name = {os.path.basename(p): float(m.mean()) for p, m in zip(batch["image_paths"], batch["masks"])}
    assert weights_by_name["a.png"] == 1.0 and abs(masks_by_name["a.png"] - 128 / 255) < 1e-6
    assert sorted(batch["captions"]) == ["x", "x", "y", "y"]  # no caption files: class tokens
    assert batch["original_sizes_hw"].tolist() == [[128, 64]] * 4
    assert batch["crop_top_lefts"].tolist() == [[0, 0]] * 4 and batch["target_sizes_hw"].tolist() == [[128, 64]] * 4


def test_undecodable_image_is_skipped_and_an_all_bad_batch_is_empty(tmp_path):
    train = folder(tmp_path, "train/1_x", [(64, 64)] * 2, caption="x")
    data = build_training_data(opts(tmp_path / "train", train_batch_size=2), FAMILY)
    data.plan(10, 1)
    [ref] = data.epoch_batches(1, 0)
    with open(os.path.join(train, "p1.png"), "wb") as f:
        f.write(b"\x89PNG broken")
    batch = data.load_batch(ref)
    assert batch["skipped_images"] == [os.path.join(train, "p1.png")] and len(batch["captions"]) == 1
    assert batch["images"].shape[0] == 1
    os.replace(os.path.join(train, "p1.png"), os.path.join(train, "p2.png"))
    empty = data.load_batch(ref)
    assert empty["image_paths"] == [] and sorted(empty["skipped_images"]) == [os.path.join(train, "p1.png"),
                                                                              os.path.join(train, "p2.png")]


def test_latent_cache_memory_disk_reuse_and_rebuild(tmp_path):
    train = folder(tmp_path, "train/2_x", [(64, 64), (64, 64), (128, 64)], caption="x")
    data = build_training_data(opts(tmp_path / "train", flip_aug=True, train_batch_size=2, resolution="64,128"), FAMILY)
    calls = []
    data.cache_latents(fake_encode(calls), "vae-a", to_disk=True, batch_size=4, num_workers=0)
    assert calls == [1, 1, 2, 2]  # one bucket at a time, plain and flipped
    assert sorted(n for n in os.listdir(train) if n.endswith(".npz")) == [
        "p1_0064x0064_sd.npz", "p2_0064x0064_sd.npz", "p3_0128x0064_sd.npz"]
    data.plan(10, 1)
    ref = data.epoch_batches(1, 0)[0]
    batch = data.load_batch(ref)
    assert batch["images"] is None and batch["latents"].shape[1:] == (4, ref.bucket[1] // 8, ref.bucket[0] // 8)

    again = build_training_data(opts(tmp_path / "train", flip_aug=True, train_batch_size=2, resolution="64,128"), FAMILY)
    calls.clear()
    again.cache_latents(fake_encode(calls), "vae-a", to_disk=True, batch_size=4, num_workers=0)
    assert calls == [] and len(again.latents) == 3  # every entry came from disk
    again.plan(10, 1)
    assert torch.equal(again.load_batch(ref)["latents"], batch["latents"])

    changed = build_training_data(opts(tmp_path / "train", flip_aug=True, train_batch_size=2, resolution="64,128"), FAMILY)
    changed.cache_latents(fake_encode(calls), "vae-b", to_disk=True, batch_size=4, num_workers=0)
    assert calls == [1, 1, 2, 2]  # another VAE: all stale, all rebuilt
    same_memory = []
    changed.cache_latents(fake_encode(same_memory), "vae-b", to_disk=False, batch_size=4, num_workers=0)
    assert same_memory == []


def test_batch_dataset_in_a_dataloader(tmp_path):
    folder(tmp_path, "train/1_x", [(64, 64)] * 3, caption="x")
    data = build_training_data(opts(tmp_path / "train", train_batch_size=2), FAMILY)
    data.plan(10, 1)
    loader = torch.utils.data.DataLoader(BatchDataset(data, data.epoch_batches(1, 0)), batch_size=None, num_workers=0)
    assert sorted(b["images"].shape[0] for b in loader) == [1, 2]


def test_metadata_with_a_dataset_config(tmp_path, monkeypatch):
    folder(tmp_path, "imgs", [(64, 64)] * 2, caption="sks")
    (tmp_path / "d.toml").write_text(f"""
[general]
caption_extension = ".txt"
[[datasets]]
resolution = 64
batch_size = 2
[[datasets.subsets]]
image_dir = "{tmp_path / 'imgs'}"
num_repeats = 3
""")
    data = build_training_data(DataOptions(dataset_config=str(tmp_path / "d.toml"), seed=3), FAMILY)
    meta = data.metadata()
    [ds] = json.loads(meta["ss_datasets"])
    assert (ds["is_dreambooth"], ds["batch_size_per_device"], ds["num_train_images"], ds["resolution"]) == (True, 2, 6, [64, 64])
    assert ds["tag_frequency"] == {"imgs": {"sks": 2, "tag1": 1, "tag2": 1}}
    assert ds["subsets"][0]["num_repeats"] == 3 and ds["subsets"][0]["img_count"] == 2
    assert (meta["ss_num_train_images"], meta["ss_num_batches_per_epoch"]) == ("6", "3")
    assert "ss_resolution" not in meta
