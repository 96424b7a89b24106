"""Hugging Face `datasets` on disk as a subset source (dataset_name / image_column / caption_column / dataset_split)."""

import io
import os

import numpy as np
import pytest
from PIL import Image

from library.core.errors import DataError
from library.data import DataFamilyInfo, build_training_data
from library.data.options import DataOptions
from tests.train_helpers import base_args, make_trainer

datasets = pytest.importorskip("datasets")

FAMILY = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8, latent_channels=4)
SIZES = [(64, 64), (128, 64), (64, 128)]
CAPTIONS = ["red square, one", "green wide, two", None]


def _image(i, size):
    img = np.zeros((size[1], size[0], 3), np.uint8)
    img[..., i % 3] = 200
    return Image.fromarray(img)


def _dataset(captions=CAPTIONS, image_col="image", caption_col="text"):
    return datasets.Dataset.from_dict(
        {image_col: [_image(i, s) for i, s in enumerate(SIZES)], caption_col: list(captions)},
        features=datasets.Features({image_col: datasets.Image(), caption_col: datasets.Value("string")}))


def _toml(tmp_path, subset: str, general: str = "") -> str:
    path = tmp_path / "dataset.toml"
    path.write_text(f'[general]\n{general}\n[[datasets]]\nresolution = 128\nenable_bucket = true\n'
                    f'bucket_no_upscale = true\nmin_bucket_reso = 64\nmax_bucket_reso = 128\nbatch_size = 1\n[[datasets.subsets]]\n{subset}\n')
    return str(path)


def _build(toml, **kw):
    return build_training_data(DataOptions(dataset_config=toml, seed=5, **kw), FAMILY)


def _check_samples(data):
    rows = sorted(data.samples, key=lambda s: os.path.basename(s.path))
    assert [os.path.basename(s.path) for s in rows] == ["00000000.png", "00000001.png", "00000002.png"]
    assert [s.caption for s in rows] == ["red square, one", "green wide, two", "sks thing"]  # None -> class tokens
    assert [s.size for s in rows] == SIZES
    assert [s.num_repeats for s in rows] == [2, 2, 2]
    [group] = data.groups
    assert {b: sorted(ids) for b, ids in group.buckets.items()} == {
        (64, 64): [rows[0].id] * 2, (128, 64): [rows[1].id] * 2, (64, 128): [rows[2].id] * 2}


SUBSET = 'num_repeats = 2\nclass_tokens = "sks thing"\n'


def test_save_to_disk_dataset_rows_become_samples(tmp_path):
    _dataset().save_to_disk(str(tmp_path / "ds"))
    data = _build(_toml(tmp_path, f'dataset_name = "{tmp_path / "ds"}"\n' + SUBSET))
    _check_samples(data)
    # The row images are cached once, byte for byte, under the dataset's fingerprint.
    folder = os.path.dirname(data.samples[0].path)
    assert os.path.basename(os.path.dirname(folder)) == "datasets"
    assert os.path.basename(folder) == datasets.load_from_disk(str(tmp_path / "ds"))._fingerprint
    # A second build reuses them (same paths, same files).
    again = _build(_toml(tmp_path, f'dataset_name = "{tmp_path / "ds"}"\n' + SUBSET))
    assert [s.path for s in again.samples] == [s.path for s in data.samples]


def test_parquet_file_and_dataset_dict_split_and_caption_options(tmp_path):
    _dataset(image_col="img", caption_col="caption").to_parquet(str(tmp_path / "rows.parquet"))
    toml = _toml(tmp_path, f'dataset_name = "{tmp_path / "rows.parquet"}"\nimage_column = "img"\n'
                           f'caption_column = "caption"\ndataset_split = "any"\n' + SUBSET,
                 general='caption_prefix = "photo"\nshuffle_caption = true\nkeep_tokens = 1\n')
    data = _build(toml)
    _check_samples(data)
    data.plan(10, 1)
    captions = sorted(data.load_batch(ref)["captions"][0] for ref in data.epoch_batches(1, 0))
    # The prefix joins the first tag, which keep_tokens = 1 keeps in place; one tag is left to shuffle.
    assert captions == ["photo green wide, two"] * 2 + ["photo red square, one"] * 2 + ["photo sks thing"] * 2
    dd = datasets.DatasetDict({"train": _dataset(), "test": _dataset(captions=["a", "b", "c"])})
    dd.save_to_disk(str(tmp_path / "dd"))
    data = _build(_toml(tmp_path, f'dataset_name = "{tmp_path / "dd"}"\ndataset_split = "test"\n'))
    assert sorted(s.caption for s in data.samples) == ["a", "b", "c"]
    with pytest.raises(DataError, match=r"dataset_split: no split 'valid' in .*dd \(splits: test, train\)$"):
        _build(_toml(tmp_path, f'dataset_name = "{tmp_path / "dd"}"\ndataset_split = "valid"\n'))


def test_imagefolder_uses_the_files_where_they_are(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    lines = []
    for i, size in enumerate(SIZES):
        _image(i, size).save(folder / f"p{i}.png")
        lines.append(f'{{"file_name": "p{i}.png", "text": "{CAPTIONS[i] or ""}"}}')
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    data = _build(_toml(tmp_path, f'dataset_name = "{folder}"\n' + SUBSET))
    rows = sorted(data.samples, key=lambda s: s.path)
    assert [s.path for s in rows] == [str(folder / f"p{i}.png") for i in range(3)]
    assert [s.caption for s in rows] == ["red square, one", "green wide, two", "sks thing"]
    assert [data.groups[0].placements[s.id].bucket for s in rows] == SIZES


def test_missing_columns_and_undecodable_rows_are_one_line_each(tmp_path):
    _dataset().save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DataError) as e:
        _build(_toml(tmp_path, f'dataset_name = "{tmp_path / "ds"}"\ncaption_column = "caption"\n'))
    assert str(e.value) == (f"datasets[0].subsets[0].caption_column: no column 'caption' in {tmp_path / 'ds'} "
                            "(columns: image, text)")
    good = io.BytesIO()
    _image(0, (64, 64)).save(good, format="PNG")
    broken = datasets.Dataset.from_dict(
        {"image": [{"bytes": good.getvalue(), "path": None}, {"bytes": b"not an image", "path": None},
                   {"bytes": good.getvalue()[:60], "path": "x.png"}], "text": ["a", "b", "c"]},
        features=datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")}))
    broken.save_to_disk(str(tmp_path / "broken"))
    with pytest.raises(DataError) as e:
        _build(_toml(tmp_path, f'dataset_name = "{tmp_path / "broken"}"\n'))
    lines = str(e.value).splitlines()
    assert lines[0] == "2 problems in the training data; fix them and start again:"
    assert lines[1] == f"  {tmp_path / 'broken'} row 1: not a recognised image format"
    assert lines[2].startswith(f"  {tmp_path / 'broken'} row 2: cannot decode image: ")
    with pytest.raises(DataError, match=r"^datasets\[0\]\.subsets\[0\]\.dataset_name: not found: .*nope$"):
        _build(_toml(tmp_path, f'dataset_name = "{tmp_path / "nope"}"\n'))


def test_one_training_step_from_a_dataset_through_the_toml(tmp_path):
    _dataset().save_to_disk(str(tmp_path / "ds"))
    toml = _toml(tmp_path, f'dataset_name = "{tmp_path / "ds"}"\n' + SUBSET, general='caption_prefix = "photo"\n')
    out = str(tmp_path / "out")
    argv = base_args(str(tmp_path / "unused"), out, steps=1, extra=["--dataset_config", toml, "--cache_latents",
                                                                      "--cache_latents_to_disk"])
    i = argv.index("--train_data_dir")
    del argv[i:i + 2]
    trainer = make_trainer(argv)
    assert trainer.run() == os.path.join(out, "lora.safetensors")
    folder = os.path.dirname(trainer.data.samples[0].path)
    assert sorted(n for n in os.listdir(folder) if n.endswith(".npz")) == [
        "00000000_0064x0064_sd.npz", "00000001_0128x0064_sd.npz", "00000002_0064x0128_sd.npz"]
