"""Dataset TOML schema: precedence, conversions and every error form."""

import argparse
import os

import pytest

from library.cli.dataset import add_dataset_arguments, data_options_from_args
from library.core.errors import ConfigError
from library.data.config import resolve_datasets, resolve_from_toml
from library.data.options import DataOptions


def write(tmp_path, text, name="dataset.toml"):
    (tmp_path / name).write_text(text)
    return name


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def resolve(in_tmp, text, **cli):
    path = write(in_tmp, text)
    return resolve_datasets(DataOptions(dataset_config=path, **cli)).datasets


def error_of(in_tmp, text, **cli):
    with pytest.raises(ConfigError) as e:
        resolve(in_tmp, text, **cli)
    return str(e.value)


def test_precedence_subset_dataset_general_cli_default(in_tmp):
    datasets = resolve(in_tmp, """
[general]
shuffle_caption = true
keep_tokens = 2
caption_extension = ".cap"
[[datasets]]
resolution = 768
keep_tokens = 3
[[datasets.subsets]]
image_dir = "a"
num_repeats = 5
keep_tokens = 4
[[datasets.subsets]]
image_dir = "b"
""", caption_extension=".txt", flip_aug=True, resolution="512", train_batch_size=3)
    a, b = datasets[0].subsets
    assert (a.num_repeats, a.captions.keep_tokens, b.num_repeats, b.captions.keep_tokens) == (5, 4, 1, 3)
    assert a.captions.shuffle_caption and b.captions.shuffle_caption  # general
    assert a.caption_extension == ".cap"  # general beats CLI
    assert a.flip_aug is True and a.color_aug is False  # CLI, then default
    assert datasets[0].resolutions == [(768, 768)] and datasets[0].batch_sizes == [3]
    assert a.kind == "dreambooth" and a.where == "datasets[0].subsets[0]"


def test_type_error_names_file_path_and_value(in_tmp):
    msg = error_of(in_tmp, """
[[datasets]]
resolution = 512
[[datasets.subsets]]
image_dir = "a"
[[datasets.subsets]]
image_dir = "b"
num_repeats = "ten"
""")
    assert msg == 'dataset.toml: datasets[0].subsets[1].num_repeats: expected an integer >= 1, got "ten"'


def test_unknown_key_suggests_the_closest(in_tmp):
    msg = error_of(in_tmp, """
[[datasets]]
resolution = 512
[[datasets.subsets]]
image_dir = "a"
num_repeat = 3
""")
    assert msg == "dataset.toml: datasets[0].subsets[0].num_repeat: unknown key (did you mean num_repeats?)"


def test_all_errors_are_listed_one_per_line(in_tmp):
    msg = error_of(in_tmp, """
[general]
image_dir = "x"
flip_aug = "yes"
[[datasets]]
resolution = "big"
batch_size = 0
[[datasets.subsets]]
metadata_file = "m.json"
[[datasets.subsets]]
image_dir = "b"
caption_dropout_rate = 1.5
""")
    assert msg.splitlines() == [
        "dataset.toml: general.image_dir: not allowed here (allowed only in [[datasets.subsets]])",
        'dataset.toml: general.flip_aug: expected true or false, got "yes"',
        'dataset.toml: datasets[0].resolution: expected resolution as a positive integer, [width, height] or a list of those, got "big"',
        "dataset.toml: datasets[0].batch_size: expected an integer >= 1 or a list of those (one per resolution), got 0",
        "dataset.toml: datasets[0].subsets[1].caption_dropout_rate: expected a number from 0 to 1, got 1.5",
        "dataset.toml: datasets[0]: mixes DreamBooth subsets (image_dir) and fine-tune subsets (metadata_file); "
        "put them in separate [[datasets]]",
    ]


def test_subset_without_source_and_bad_toml(in_tmp):
    msg = error_of(in_tmp, "[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nnum_repeats = 2\n")
    assert msg == ("dataset.toml: datasets[0].subsets[0]: needs image_dir (DreamBooth subset), metadata_file (fine-tune subset) "
                   "or dataset_name (a datasets folder or file)")
    assert error_of(in_tmp, "[[datasets]\n").startswith("dataset.toml: not valid TOML: ")
    with pytest.raises(ConfigError, match=r"^--dataset_config: file not found: nope.toml$"):
        resolve_from_toml("nope.toml", DataOptions())


def test_missing_resolution_and_fine_tune_reg(in_tmp):
    msg = error_of(in_tmp, '[[datasets]]\n[[datasets.subsets]]\nmetadata_file = "m.json"\nis_reg = true\n')
    assert msg.splitlines() == [
        "dataset.toml: datasets[0].subsets[0].is_reg: only DreamBooth subsets (image_dir without metadata_file) "
        "can be regularization images",
        "dataset.toml: datasets[0]: no resolution: set resolution in the dataset config or pass --resolution",
    ]


@pytest.mark.parametrize("value, expected", [
    ("512", [(512, 512)]),
    ("[512, 768]", [(512, 768)]),  # width, height as in sd-scripts
    ("[[512, 512], [768, 768]]", [(512, 512), (768, 768)]),
    ("[512, 768, 1024]", [(512, 512), (768, 768), (1024, 1024)]),
    ("[512, [640, 768]]", [(512, 512), (640, 768)]),
])
def test_resolution_forms(in_tmp, value, expected):
    ds = resolve(in_tmp, f'[[datasets]]\nresolution = {value}\n[[datasets.subsets]]\nimage_dir = "a"\n')[0]
    assert ds.resolutions == expected and ds.batch_sizes == [1] * len(expected)


@pytest.mark.parametrize("flag, expected", [("512", [(512, 512)]), ("512,768", [(512, 768)]),
                                            ("512;768", [(512, 512), (768, 768)]),
                                            ("512,512;768,1024", [(512, 512), (768, 1024)])])
def test_cli_resolution_forms(in_tmp, flag, expected):
    ds = resolve(in_tmp, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "a"\n', resolution=flag)[0]
    assert ds.resolutions == expected


def test_cli_value_errors_name_the_flag(in_tmp):
    msg = error_of(in_tmp, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "a"\n', resolution="abc", keep_tokens=-1)
    assert msg.splitlines() == [
        '--resolution: expected "SIZE" or "WIDTH,HEIGHT", several separated by ";", got "abc"',
        "--keep_tokens: expected an integer >= 0, got -1",
    ]


def test_batch_size_list_per_resolution(in_tmp):
    ds = resolve(in_tmp, '[[datasets]]\nresolution = [[512,512],[768,768]]\nbatch_size = [4, 2]\n'
                         '[[datasets.subsets]]\nimage_dir = "a"\n')[0]
    assert ds.batch_sizes == [4, 2]
    msg = error_of(in_tmp, '[[datasets]]\nresolution = [[512,512],[768,768]]\nbatch_size = [4, 2, 1]\n'
                           '[[datasets.subsets]]\nimage_dir = "a"\n')
    assert msg == "dataset.toml: datasets[0].batch_size: expected one value or 2 values (one per resolution), got 3"


def test_progressive_schedule_sorted_low_to_high(in_tmp):
    ds = resolve(in_tmp, '[[datasets]]\nresolution = [[768,768],[512,512]]\nbatch_size = [2, 4]\n'
                         'resolution_schedule = "progressive"\nresolution_step_fractions = [0.25, 0.75]\n'
                         '[[datasets.subsets]]\nimage_dir = "a"\n')[0]
    assert ds.resolutions == [(512, 512), (768, 768)] and ds.batch_sizes == [4, 2]
    assert ds.resolution_step_fractions == [0.25, 0.75]


@pytest.mark.parametrize("res, fractions, message", [
    ("[[512,512],[768,768]]", "[0.5, 0.6]", "resolution_step_fractions: expected fractions that sum to 1.0, got sum 1.1"),
    ("[[512,512],[768,768]]", "[1.0]", "resolution_step_fractions: expected 2 fractions (one per resolution), got 1"),
    ("512", "[1.0]", 'resolution_schedule: "progressive" needs at least 2 resolutions, got 1'),
])
def test_progressive_errors(in_tmp, res, fractions, message):
    msg = error_of(in_tmp, f'[[datasets]]\nresolution = {res}\nresolution_schedule = "progressive"\n'
                           f'resolution_step_fractions = {fractions}\n[[datasets.subsets]]\nimage_dir = "a"\n')
    assert msg == f"dataset.toml: datasets[0].{message}"


def test_option_conflicts(in_tmp):
    text = '[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "a"\ncolor_aug = true\n'
    assert error_of(in_tmp, text, cache_latents=True) == (
        "dataset.toml: datasets[0].subsets[0]: color_aug changes the image every step, so it cannot be used "
        "with --cache_latents/--cache_latents_to_disk")
    text = '[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "a"\n'
    # Whether a masked_loss subset has masks (alpha, folder or -masklabel.png files) is checked after
    # discovery (tests/test_masked_training.py); the config only carries the switch down to the subset.
    assert resolve(in_tmp, text, masked_loss=True)[0].subsets[0].masked_loss
    ok = resolve(in_tmp, text.replace('"a"\n', '"a"\nalpha_mask = true\n'), masked_loss=True)
    assert ok[0].subsets[0].alpha_mask
    assert error_of(in_tmp, text.replace('"a"\n', '"a"\nconditioning_data_dir = "m"\n')) == (
        "dataset.toml: datasets[0].subsets[0]: conditioning_data_dir (mask images) needs --masked_loss (or masked_loss = true)")


def test_subset_level_validation_split_and_fine_tune(in_tmp):
    ds = resolve(in_tmp, '[[datasets]]\nresolution = 512\nvalidation_split = 0.1\n'
                         '[[datasets.subsets]]\nmetadata_file = "m.json"\nvalidation_split = 0.25\nvalidation_seed = 7\n')[0]
    sub = ds.subsets[0]
    assert (sub.kind, sub.validation_split, sub.validation_seed) == ("finetune", 0.25, 7)


def test_folder_mode_flags(tmp_path):
    (tmp_path / "train" / "10_sks dog").mkdir(parents=True)
    (tmp_path / "train" / "notes").mkdir()
    (tmp_path / "reg" / "1_dog").mkdir(parents=True)
    opts = DataOptions(train_data_dir=str(tmp_path / "train"), reg_data_dir=str(tmp_path / "reg"), resolution="512")
    resolved = resolve_datasets(opts)
    subs = resolved.datasets[0].subsets
    assert [(os.path.basename(s.image_dir), s.num_repeats, s.class_tokens, s.is_reg) for s in subs] == [
        ("10_sks dog", 10, "sks dog", False), ("1_dog", 1, "dog", True)]
    assert resolved.from_config_file is False and resolved.problems == []
    with pytest.raises(ConfigError, match="^no training data: pass --dataset_config, --train_data_dir or --in_json$"):
        resolve_datasets(DataOptions(resolution="512"))


def test_argparse_flags_and_defaults():
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    defaults = data_options_from_args(parser.parse_args([]))
    assert defaults == DataOptions()
    assert (defaults.caption_extension, defaults.max_data_loader_n_workers, defaults.resolution) == (".caption", 8, None)
    ns = parser.parse_args(["--caption_extention", ".txt", "--resolution", "512,768", "--enable_bucket",
                            "--train_batch_size", "4", "--face_crop_aug_range", "2.0,4.0"])
    opts = data_options_from_args(ns)
    assert (opts.caption_extension, opts.resolution, opts.enable_bucket, opts.train_batch_size,
            opts.face_crop_aug_range) == (".txt", "512,768", True, 4, "2.0,4.0")
    assert 0 <= DataOptions(max_data_loader_n_workers=1000).data_loader_workers() <= (os.cpu_count() or 1)
