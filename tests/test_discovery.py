"""Finding images, captions, masks and metadata; folder mode; reg balancing."""

import json
import os

from PIL import Image

from library.data.batching import balance_reg_repeats
from library.data.config import SubsetConfig
from library.data.discovery import caption_candidates, discover_subset, find_mask
from library.data.folders import find_repeat_folders, list_images


def png(path, size=(64, 64), color=(255, 0, 0)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return str(path)


def db_subset(folder, **kw):
    return SubsetConfig(where="datasets[0].subsets[0]", kind="dreambooth", image_dir=str(folder), **kw)


def test_repeat_folders_and_skipped_ones(tmp_path):
    for name in ("10_sks dog", "2_a_b", "notes", "0_zero"):
        (tmp_path / name).mkdir()
    found, problems = find_repeat_folders(str(tmp_path), "--train_data_dir")
    assert [(os.path.basename(p), n, tokens) for p, n, tokens in found] == [("10_sks dog", 10, "sks dog"), ("2_a_b", 2, "a_b")]
    assert problems == []


def test_no_repeat_folder_explains_why(tmp_path):
    png(tmp_path / "img.png")
    assert find_repeat_folders(str(tmp_path), "--train_data_dir") == ([], [
        f"--train_data_dir: no images found in {tmp_path}: no subfolders named like 10_name (N_ prefix = repeats); "
        "the images must be inside N_name subfolders, not directly in this folder"])
    (tmp_path / "dogs").mkdir()
    assert find_repeat_folders(str(tmp_path), "--reg_data_dir")[1] == [
        f"--reg_data_dir: no images found in {tmp_path}: no subfolders named like 10_name (N_ prefix = repeats); skipped: dogs"]
    missing = str(tmp_path / "nope")
    assert find_repeat_folders(missing, "--train_data_dir")[1] == [
        f"--train_data_dir: no images found in {missing}: the folder does not exist"]


def test_captions_class_tokens_and_empty_caption_files(tmp_path):
    a, b, c = png(tmp_path / "a.png"), png(tmp_path / "b.jpg"), png(tmp_path / "c.webp")
    (tmp_path / "a.txt").write_text("sks dog, red\n\n  second line  \n")
    (tmp_path / "c.txt").write_text("  \n")
    (tmp_path / "readme.md").write_text("x")
    result = discover_subset(db_subset(tmp_path, caption_extension=".txt", class_tokens="sks dog"))
    assert [(os.path.basename(i.path), i.caption) for i in result.images] == [
        ("a.png", "sks dog, red\nsecond line"), ("b.jpg", "sks dog")]
    assert result.missing_captions == 1
    assert result.problems == [f"{tmp_path / 'c.txt'}: empty caption file (delete it to use the class tokens, or write a caption)"]
    assert list_images(str(tmp_path)) == [a, b, c]


def test_face_suffix_caption_fallback(tmp_path):
    img = png(tmp_path / "face_10_20_30_40.png")
    assert caption_candidates(img, ".txt") == [str(tmp_path / "face_10_20_30_40.txt"), str(tmp_path / "face.txt")]
    (tmp_path / "face.txt").write_text("a face")
    assert discover_subset(db_subset(tmp_path, caption_extension=".txt")).images[0].caption == "a face"


def test_no_images_reasons(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    (tmp_path / "5_cats").mkdir()
    result = discover_subset(db_subset(tmp_path))
    assert result.problems == [
        f"datasets[0].subsets[0]: no images found in {tmp_path}: no files with extensions .png, .jpg, .jpeg, .webp, .bmp "
        "(1 other files); it has N_name subfolders: point image_dir at each of them"]
    missing = tmp_path / "gone"
    assert discover_subset(db_subset(missing)).problems == [
        f"datasets[0].subsets[0]: no images found in {missing}: the folder does not exist"]


def test_masks_from_conditioning_dir(tmp_path):
    png(tmp_path / "img" / "a.png")
    png(tmp_path / "img" / "b.png")
    mask = png(tmp_path / "mask" / "a.png")
    assert find_mask(str(tmp_path / "img" / "a.png"), str(tmp_path / "mask")) == mask
    result = discover_subset(db_subset(tmp_path / "img", conditioning_data_dir=str(tmp_path / "mask")))
    assert [os.path.basename(i.mask_path or "-") for i in result.images] == ["a.png", "-"]
    assert result.problems == [f"{tmp_path / 'img' / 'b.png'}: no mask image with the same name in {tmp_path / 'mask'}"]


def test_fine_tune_json_and_jsonl(tmp_path):
    png(tmp_path / "a.png")
    png(tmp_path / "b.jpg")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"a": {"caption": "a cat", "tags": "red, fluffy"}, "b.jpg": {"tags": "dog"},
                                "c": {"caption": "missing"}, "a.png": {}}))
    sub = SubsetConfig(where="datasets[0].subsets[0]", kind="finetune", image_dir=str(tmp_path), metadata_file=str(meta))
    result = discover_subset(sub)
    assert [(os.path.basename(i.path), i.caption) for i in result.images] == [("a.png", "a cat, red, fluffy"), ("b.jpg", "dog")]
    assert result.problems == [f"{meta}: c: image not found in {tmp_path}", f"{meta}: a.png: no caption or tags"]

    jsonl = tmp_path / "meta.jsonl"
    jsonl.write_text(json.dumps({"image_path": str(tmp_path / "a.png"), "caption": "x"}) + "\n{bad\n\n"
                     + json.dumps({"caption": "no path"}) + "\n")
    result = discover_subset(SubsetConfig(where="s", kind="finetune", metadata_file=str(jsonl)))
    assert [i.caption for i in result.images] == ["x"]
    assert result.problems[0].startswith(f"{jsonl}: line 2: not valid JSON")
    assert result.problems[1] == f'{jsonl}: line 4: expected an object with "image_path"'


def test_reg_balancing_golden():
    assert balance_reg_repeats(10, [1, 1, 1]) == [4, 3, 3]  # round-robin up to the train count
    assert balance_reg_repeats(2, [1, 1, 1]) == [1, 1, 0]  # more reg images than needed: the rest are unused
    assert balance_reg_repeats(7, [3, 1]) == [5, 2]  # 3+1, then +1 each pass: 4+2, 5+2
    assert balance_reg_repeats(5, []) == []
