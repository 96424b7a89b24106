"""finetune/: merge, clean, buckets + latents, BLIP captions and WD14 tags on small images the tests write,
and a training run that consumes the metadata JSON the tools wrote."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from finetune import (
    clean_captions_and_tags,
    make_captions,
    merge_captions_to_metadata,
    merge_dd_tags_to_metadata,
    prepare_buckets_latents,
    tag_images_by_wd14_tagger,
)
from library.data.finetune_metadata import clean_caption, clean_tags
from tests.train_helpers import make_trainer


def _image(path: str, size: tuple[int, int], color: tuple[int, int, int]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, color).save(path)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture
def folder(tmp_path) -> str:
    """imgs/{a.png 64x64, b.jpg 128x64, sub/c.png 64x128}; a and b have .caption and .txt files, c only a .caption."""
    root = str(tmp_path / "imgs")
    _image(os.path.join(root, "a.png"), (64, 64), (200, 20, 20))
    _image(os.path.join(root, "b.jpg"), (128, 64), (20, 200, 20))
    _image(os.path.join(root, "sub", "c.png"), (64, 128), (20, 20, 200))
    _write(os.path.join(root, "a.caption"), "a young woman in red\n")
    _write(os.path.join(root, "b.caption"), "a green picture")
    _write(os.path.join(root, "sub", "c.caption"), "blue")
    _write(os.path.join(root, "a.txt"), "1girl, solo, long_hair, white_shirt, shirt, rating:safe")
    _write(os.path.join(root, "b.txt"), "2girls, blue_eyes, red_eyes, smile")
    return root


# ----------------------------------------------------------------------------------------- merge
def test_merge_captions_then_tags_exact_json(folder, tmp_path, caplog):
    out = str(tmp_path / "meta.json")
    assert merge_captions_to_metadata.main([folder, out]) == 0
    assert _read_json(out) == {"a": {"caption": "a young woman in red"}, "b": {"caption": "a green picture"}}
    # Rerun without --in_json: out_json is read and updated (other fields kept), as sd-scripts.
    assert merge_dd_tags_to_metadata.main([folder, out]) == 0
    assert _read_json(out) == {
        "a": {"caption": "a young woman in red", "tags": "1girl, solo, long_hair, white_shirt, shirt, rating:safe"},
        "b": {"caption": "a green picture", "tags": "2girls, blue_eyes, red_eyes, smile"},
    }
    with open(out, encoding="utf-8") as f:
        assert f.read().startswith('{\n  "a": {\n    "caption"')  # json.dumps(indent=2), as sd-scripts writes it


def test_merge_recursive_relative_keys_and_missing_files(folder, tmp_path, caplog):
    out = str(tmp_path / "meta.json")
    assert merge_captions_to_metadata.main([folder, out, "--recursive"]) == 0
    assert _read_json(out) == {"a": {"caption": "a young woman in red"}, "b": {"caption": "a green picture"},
                               "sub/c": {"caption": "blue"}}
    assert merge_dd_tags_to_metadata.main([folder, out, "--recursive", "--caption_extension", "txt"]) == 0
    assert _read_json(out)["sub/c"] == {"caption": "blue"}  # no sub/c.txt: left out, with a warning
    assert "1 images have no (or an empty) .txt file and were left out" in caplog.text
    # The trainer's --in_json reader finds every image of these keys under --train_data_dir.
    from library.data.finetune_metadata import read_metadata_entries, resolve_image

    entries, problems = read_metadata_entries(out)
    assert problems == []
    assert {key: resolve_image(key, folder) for key, _ in entries} == {
        "a": os.path.join(folder, "a.png"), "b": os.path.join(folder, "b.jpg"), "sub/c": os.path.join(folder, "sub/c.png")}


def test_merge_full_path_keys_and_in_json(folder, tmp_path):
    first = str(tmp_path / "first.json")
    _write(first, json.dumps({"x": {"caption": "kept"}}))
    out = str(tmp_path / "meta.json")
    assert merge_captions_to_metadata.main([folder, out, "--in_json", first, "--full_path"]) == 0
    a, b = os.path.abspath(os.path.join(folder, "a.png")), os.path.abspath(os.path.join(folder, "b.jpg"))
    assert _read_json(out) == {"x": {"caption": "kept"}, a: {"caption": "a young woman in red"},
                               b: {"caption": "a green picture"}}


def test_merge_errors_are_one_line(tmp_path, capsys):
    assert merge_captions_to_metadata.main([str(tmp_path / "nope"), str(tmp_path / "o.json")]) == 2
    assert capsys.readouterr().err == f"error: train_data_dir: folder not found: {tmp_path / 'nope'}\n"
    _image(str(tmp_path / "d" / "a.png"), (8, 8), (0, 0, 0))
    _image(str(tmp_path / "d" / "a.jpg"), (8, 8), (0, 0, 0))
    assert merge_captions_to_metadata.main([str(tmp_path / "d"), str(tmp_path / "o.json")]) == 2
    assert "have the same metadata key 'a'" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert clean_captions_and_tags.main([str(bad), str(tmp_path / "o.json")]) == 2
    assert capsys.readouterr().err == f"error: {bad}: expected a JSON object {{image: {{caption, tags}}}}\n"
    assert not os.path.exists(tmp_path / "o.json")


# ----------------------------------------------------------------------------------------- clean
@pytest.mark.parametrize("tags, expected", [
    ("1girl, solo, long_hair, white_shirt, shirt, smile", "1girl, solo, long hair, white shirt, smile"),
    ("2girls, long_hair, short_hair, blue_eyes, red_eyes, blonde_hair, black_hair, ponytail, twintails, smile",
     "2girls, smile"),
    ("2girls, long_hair, blonde_hair, black_hair, hair_ornament, red_hair_ornament", "2girls, long hair, red hair ornament"),
    ("multiple_boys, long_sleeves, short_sleeves, bob_cut, hime_cut, hair_bun, ahoge", "multiple boys"),
    ("1girl, ^_^, closed_eyes, rating:safe, rating:general", "1girl, ^_^, closed eyes"),
    ("1boy, jacket, black_jacket, open_jacket", "1boy, black jacket, open jacket"),
    ("", ""),
])
def test_clean_tags_follows_sd_scripts_rules(tags, expected):
    assert clean_tags(tags) == expected


def test_clean_caption_replacements():
    assert clean_caption("a cartoon image of a young woman with a person") == "an image of a girl with a girl"
    assert clean_caption("anime anime girl and women") == "girl and girls"


def test_clean_script_exact_json_and_old_three_argument_form(tmp_path, caplog):
    src = str(tmp_path / "in.json")
    _write(src, json.dumps({"a": {"caption": "a young woman in red", "tags": "1girl, white_shirt, shirt, rating:safe"},
                            "b": {"tags": "solo"}, "c": {"caption": "a lady", "train_resolution": [64, 64]}}))
    out = str(tmp_path / "out.json")
    expected = {"a": {"caption": "a girl in red", "tags": "1girl, white shirt"}, "b": {"tags": "solo"},
                "c": {"caption": "a girl", "train_resolution": [64, 64]}}
    assert clean_captions_and_tags.main([src, out]) == 0
    assert _read_json(out) == expected
    assert "1 entries have no tags: c" in caplog.text and "1 entries have no caption: b" in caplog.text
    os.remove(out)
    assert clean_captions_and_tags.main([str(tmp_path), src, out]) == 0
    assert _read_json(out) == expected


# ----------------------------------------------------------------------------------------- buckets + latents
def _bucket_flags():
    return ["--max_resolution", "128,128", "--min_bucket_reso", "64", "--max_bucket_reso", "256",
            "--bucket_reso_steps", "64"]


def test_prepare_buckets_latents_then_training_reuses_every_latent(tmp_path, monkeypatch):
    root = str(tmp_path / "imgs")
    _image(os.path.join(root, "sq.png"), (128, 128), (200, 20, 20))
    _image(os.path.join(root, "wide.png"), (192, 64), (20, 200, 20))
    _image(os.path.join(root, "tall.png"), (64, 256), (20, 20, 200))
    meta = str(tmp_path / "meta.json")
    _write(meta, json.dumps({"sq": {"caption": "red square"}, "wide": {"caption": "green band", "tags": "green"},
                             "tall": {"tags": "blue, tall"}}))
    out = str(tmp_path / "meta_lat.json")
    args = [root, meta, out, "tiny:sd1", "--flip_aug"] + _bucket_flags()
    assert prepare_buckets_latents.main(args) == 0
    assert _read_json(out) == {
        "sq": {"caption": "red square", "train_resolution": [128, 128]},
        "wide": {"caption": "green band", "tags": "green", "train_resolution": [192, 64]},
        "tall": {"tags": "blue, tall", "train_resolution": [64, 256]},
    }
    npz = sorted(n for n in os.listdir(root) if n.endswith(".npz"))
    assert npz == ["sq_0128x0128_sd.npz", "tall_0064x0256_sd.npz", "wide_0192x0064_sd.npz"]
    with np.load(os.path.join(root, "wide_0192x0064_sd.npz")) as data:
        assert data["latents"].shape == (4, 8, 24) and data["latents_flipped"].shape == (4, 8, 24)
    mtimes = {n: os.stat(os.path.join(root, n)).st_mtime_ns for n in npz}

    # A rerun (resume) encodes nothing.
    from library.families import get_family

    sd = get_family("sd")
    encoded = []
    original = sd.encode_images
    monkeypatch.setattr(type(sd), "encode_images", lambda self, vae, x, *more: encoded.append(len(x)) or original(vae, x, *more))
    assert prepare_buckets_latents.main(args + ["--skip_existing"]) == 0
    assert encoded == []

    # The trainer, with the same settings and the JSON the tool wrote, finds every latent valid.
    trainer = make_trainer([
        "--pretrained_model_name_or_path", "tiny:sd1", "--in_json", out, "--train_data_dir", root,
        "--resolution", "128,128", "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "256",
        "--flip_aug", "--cache_latents", "--cache_latents_to_disk", "--max_data_loader_n_workers", "0",
        "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
        "--learning_rate", "1e-3", "--max_train_steps", "1", "--seed", "1",
        "--output_dir", str(tmp_path / "out"), "--output_name", "lora"])
    trainer.run()
    assert encoded == []
    assert {n: os.stat(os.path.join(root, n)).st_mtime_ns for n in npz} == mtimes
    assert os.path.isfile(tmp_path / "out" / "lora.safetensors")

    # Resume after an interruption: only the missing file is encoded (image and flipped image).
    os.remove(os.path.join(root, "tall_0064x0256_sd.npz"))
    assert prepare_buckets_latents.main(args) == 0
    assert encoded == [1, 1]
    assert sorted(n for n in os.listdir(root) if n.endswith(".npz")) == npz


def test_prepare_buckets_latents_sdxl_files_are_valid_for_tools_cache_latents(tmp_path, monkeypatch):
    from library.families import get_family
    from tools import cache_latents

    root = str(tmp_path / "imgs")
    _image(os.path.join(root, "a.png"), (64, 64), (200, 20, 20))
    _image(os.path.join(root, "b.png"), (192, 64), (20, 200, 20))
    meta = str(tmp_path / "meta.json")
    _write(meta, json.dumps({"a": {"caption": "red"}, "b": {"caption": "green"}}))
    out = str(tmp_path / "out.json")
    buckets = ["--min_bucket_reso", "32", "--max_bucket_reso", "128", "--bucket_reso_steps", "32"]
    assert prepare_buckets_latents.main([root, meta, out, "tiny:sdxl", "--sdxl", "--max_resolution", "64,64"] + buckets) == 0
    assert _read_json(out) == {"a": {"caption": "red", "train_resolution": [64, 64]},
                               "b": {"caption": "green", "train_resolution": [96, 32]}}
    assert sorted(n for n in os.listdir(root) if n.endswith(".npz")) == ["a_0064x0064_sdxl.npz", "b_0192x0064_sdxl.npz"]

    sdxl = get_family("sdxl")
    encoded = []
    original = sdxl.encode_images
    monkeypatch.setattr(type(sdxl), "encode_images", lambda self, vae, x, *more: encoded.append(len(x)) or original(vae, x, *more))
    assert cache_latents.main(["--sdxl", "--pretrained_model_name_or_path", "tiny:sdxl", "--in_json", out,
                               "--train_data_dir", root, "--resolution", "64,64", "--enable_bucket",
                               "--max_data_loader_n_workers", "0", "--output_dir", str(tmp_path / "o")] + buckets) == 0
    assert encoded == []


def test_prepare_buckets_latents_errors(tmp_path, capsys, caplog):
    root = str(tmp_path / "imgs")
    _image(os.path.join(root, "a.png"), (64, 64), (0, 0, 0))
    missing = str(tmp_path / "none.json")
    assert prepare_buckets_latents.main([root, missing, str(tmp_path / "o.json"), "tiny:sd1"]) == 2
    assert capsys.readouterr().err == f"error: {missing}: metadata file not found\n"
    meta = str(tmp_path / "m.json")
    _write(meta, "{}")
    assert prepare_buckets_latents.main([root, meta, str(tmp_path / "o.json"), "tiny:sd1", "--max_resolution", "512"]) == 2
    assert capsys.readouterr().err == "error: --max_resolution: expected 'width,height', got '512'\n"
    # A damaged image is left out with a warning; the others get their bucket.
    _write(os.path.join(root, "bad.png"), "not an image")
    out = str(tmp_path / "o.json")
    assert prepare_buckets_latents.main([root, meta, out, "tiny:sd1", "--max_resolution", "64,64",
                                         "--min_bucket_reso", "64", "--max_bucket_reso", "128"]) == 0
    assert _read_json(out) == {"a": {"train_resolution": [64, 64]}}
    assert "1 images could not be read and are left out" in caplog.text


# ----------------------------------------------------------------------------------------- BLIP
@pytest.fixture(scope="module")
def tiny_blip(tmp_path_factory) -> str:
    """A tiny BlipForConditionalGeneration + processor saved with save_pretrained (random weights)."""
    import torch
    from transformers import (
        BertTokenizer,
        BlipConfig,
        BlipForConditionalGeneration,
        BlipImageProcessor,
        BlipProcessor,
    )

    folder = str(tmp_path_factory.mktemp("blip"))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "a", "red", "square", "picture", "of", "the",
             "green", "blue", "dog", "cat"]
    vocab = os.path.join(folder, "vocab.txt")
    _write(vocab, "\n".join(words) + "\n")
    processor = BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}),
                              tokenizer=BertTokenizer(vocab, bos_token="[DEC]"))
    config = BlipConfig(
        text_config=dict(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, encoder_hidden_size=16, max_position_embeddings=64, bos_token_id=5,
                         pad_token_id=0, sep_token_id=3, eos_token_id=3),
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                           image_size=32, patch_size=16),
        projection_dim=16)
    torch.manual_seed(0)
    model_dir = os.path.join(folder, "model")
    BlipForConditionalGeneration(config).save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    return model_dir


def test_make_captions_with_tiny_blip(tiny_blip, tmp_path):
    import torch
    from transformers import BlipForConditionalGeneration, BlipProcessor

    root = str(tmp_path / "imgs")
    _image(os.path.join(root, "a.png"), (40, 30), (200, 20, 20))
    _image(os.path.join(root, "sub", "b.jpg"), (30, 40), (20, 20, 200))
    _write(os.path.join(root, "keep.caption"), "mine\n")
    _image(os.path.join(root, "keep.png"), (32, 32), (0, 0, 0))
    flags = ["--caption_weights", tiny_blip, "--beam_search", "--num_beams", "2", "--max_length", "8",
             "--min_length", "2", "--batch_size", "2"]
    assert make_captions.main([root, "--recursive", "--skip_existing"] + flags) == 0

    model = BlipForConditionalGeneration.from_pretrained(tiny_blip).eval()
    processor = BlipProcessor.from_pretrained(tiny_blip)
    for path in (os.path.join(root, "a.png"), os.path.join(root, "sub", "b.jpg")):
        with Image.open(path) as img:
            pixels = processor(images=[img.convert("RGB")], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            ids = model.generate(pixel_values=pixels, num_beams=2, do_sample=False, max_length=8, min_length=2)
        expected = processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
        with open(os.path.splitext(path)[0] + ".caption", encoding="utf-8") as f:
            assert f.read() == expected + "\n"
    with open(os.path.join(root, "keep.caption"), encoding="utf-8") as f:
        assert f.read() == "mine\n"  # --skip_existing left it alone

    # Nucleus sampling (the default) with another extension, and the captions merge into metadata.
    assert make_captions.main([root, "--caption_weights", tiny_blip, "--caption_extension", ".cap", "--max_length", "6",
                               "--min_length", "2"]) == 0
    assert sorted(n for n in os.listdir(root) if n.endswith(".cap")) == ["a.cap", "keep.cap"]


def test_make_captions_missing_weights_is_one_line(tmp_path, capsys):
    _image(str(tmp_path / "imgs" / "a.png"), (8, 8), (0, 0, 0))
    code = make_captions.main([str(tmp_path / "imgs"), "--caption_weights", str(tmp_path / "blip")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --caption_weights: {tmp_path / 'blip' / 'config.json'} not found: "
                          "expected a transformers BLIP captioning folder")
    weights = tmp_path / "model_large_caption.pth"
    weights.write_bytes(b"x")
    assert make_captions.main([str(tmp_path / "imgs"), "--model_path", str(weights)]) == 2
    assert "BLIP .pth checkpoints are not supported" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- WD14
WD14_LABELS = [("9", "general"), ("9", "sensitive"), ("9", "questionable"), ("9", "explicit"), ("0", "red_hair"),
               ("0", "blue_sky"), ("0", "smile"), ("0", "^_^"), ("4", "hatsune_miku_(vocaloid)"), ("4", "some_char")]


@pytest.fixture(scope="module")
def tiny_wd14(tmp_path_factory) -> str:
    """model_dir with SmilingWolf_wd-v1-4-convnext-tagger-v2/{model.onnx, selected_tags.csv}: a tiny ONNX graph
    sigmoid(mean_colour_BGR/255 @ W + b) over 32x32 NHWC input, so each label's probability is known:
    red image: general rating, red_hair .98, smile .5, ^_^ .88, miku .5; blue image: sensitive rating,
    blue_sky .98, smile .5, ^_^ .12, miku .5, some_char .98 (every other label .02 or below)."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    n = len(WD14_LABELS)
    w, b = np.zeros((3, n), np.float32), np.zeros(n, np.float32)
    w[2, 0] = 4          # rating "general" for red
    w[0, 1] = 4          # rating "sensitive" for blue
    w[2, 4], b[4] = 8, -4  # red_hair
    w[0, 5], b[5] = 8, -4  # blue_sky
    w[2, 7], b[7] = 4, -2  # ^_^
    w[0, 9], b[9] = 8, -4  # some_char
    model_dir = str(tmp_path_factory.mktemp("wd14"))
    location = os.path.join(model_dir, "SmilingWolf_wd-v1-4-convnext-tagger-v2")
    os.makedirs(location)
    _write(os.path.join(location, "selected_tags.csv"),
           "tag_id,name,category,count\n" + "".join(f"{i},{name},{cat},1\n" for i, (cat, name) in enumerate(WD14_LABELS)))
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input_1", "axes"], ["mean"], keepdims=0),
         helper.make_node("Div", ["mean", "scale"], ["x"]),
         helper.make_node("MatMul", ["x", "W"], ["logits"]),
         helper.make_node("Add", ["logits", "b"], ["z"]),
         helper.make_node("Sigmoid", ["z"], ["predictions_sigmoid"])],
        "tiny_wd14", [helper.make_tensor_value_info("input_1", TensorProto.FLOAT, ["N", 32, 32, 3])],
        [helper.make_tensor_value_info("predictions_sigmoid", TensorProto.FLOAT, ["N", n])],
        [numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
         numpy_helper.from_array(np.array(255, np.float32), "scale"),
         numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, os.path.join(location, "model.onnx"))
    return model_dir


def _tag_folder(tmp_path) -> str:
    root = str(tmp_path / "imgs")
    _image(os.path.join(root, "red.png"), (64, 64), (255, 0, 0))
    _image(os.path.join(root, "blue.png"), (64, 64), (0, 0, 255))
    return root


def _files(root: str, ext: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(root)):
        if name.endswith(ext):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                out[name] = f.read()
    return out


def test_wd14_tagger_thresholds_and_options(tiny_wd14, tmp_path):
    root = _tag_folder(tmp_path)
    assert tag_images_by_wd14_tagger.main([root, "--onnx", "--model_dir", tiny_wd14, "--general_threshold", "0.35",
                                           "--character_threshold", "0.6", "--remove_underscore",
                                           "--undesired_tags", "smile", "--batch_size", "2"]) == 0
    assert _files(root, ".txt") == {"blue.txt": "blue sky, some char\n", "red.txt": "red hair, ^_^\n"}

    assert tag_images_by_wd14_tagger.main([root, "--model_dir", tiny_wd14, "--thresh", "0.35", "--use_rating_tags",
                                           "--character_tags_first", "--caption_extension", ".tags"]) == 0
    assert _files(root, ".tags") == {
        "blue.tags": "sensitive, some_char, hatsune_miku_(vocaloid), blue_sky, smile\n",
        "red.tags": "general, hatsune_miku_(vocaloid), red_hair, smile, ^_^\n",
    }

    # --skip_existing leaves tagged images alone; then the tags merge into metadata.
    _write(os.path.join(root, "red.txt"), "mine\n")
    assert tag_images_by_wd14_tagger.main([root, "--onnx", "--model_dir", tiny_wd14, "--skip_existing"]) == 0
    assert _files(root, ".txt")["red.txt"] == "mine\n"
    out = str(tmp_path / "meta.json")
    assert merge_dd_tags_to_metadata.main([root, out]) == 0
    assert _read_json(out) == {"blue": {"tags": "blue sky, some char"}, "red": {"tags": "mine"}}


def test_wd14_tagger_missing_model_is_one_line(tmp_path, capsys):
    root = _tag_folder(tmp_path)
    location = tmp_path / "models" / "SmilingWolf_wd-v1-4-convnext-tagger-v2"
    assert tag_images_by_wd14_tagger.main([root, "--onnx", "--model_dir", str(tmp_path / "models")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: --model_dir: {location / 'selected_tags.csv'} not found: expected a WD14 tagger "
                          "model.onnx and selected_tags.csv")
    location.mkdir(parents=True)
    (location / "selected_tags.csv").write_text("tag_id,name,category,count\n0,general,9,1\n")
    (location / "saved_model.pb").write_bytes(b"")
    assert tag_images_by_wd14_tagger.main([root, "--model_dir", str(tmp_path / "models")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model_dir: {location / 'model.onnx'} not found") and "Keras SavedModel" in err


# ----------------------------------------------------------------------------------------- pipeline
def test_pipeline_captions_tags_clean_buckets_then_training(tiny_blip, tiny_wd14, tmp_path):
    root = _tag_folder(tmp_path)
    assert make_captions.main([root, "--caption_weights", tiny_blip, "--beam_search", "--max_length", "6",
                               "--min_length", "2"]) == 0
    assert tag_images_by_wd14_tagger.main([root, "--onnx", "--model_dir", tiny_wd14]) == 0
    meta = str(tmp_path / "meta.json")
    assert merge_captions_to_metadata.main([root, meta]) == 0
    assert merge_dd_tags_to_metadata.main([root, meta]) == 0
    clean = str(tmp_path / "clean.json")
    assert clean_captions_and_tags.main([meta, clean]) == 0
    final = str(tmp_path / "final.json")
    assert prepare_buckets_latents.main([root, clean, final, "tiny:sd1", "--max_resolution", "64,64",
                                         "--min_bucket_reso", "64", "--max_bucket_reso", "128"]) == 0
    data = _read_json(final)
    assert sorted(data) == ["blue", "red"]
    assert data["red"]["tags"] == "red hair, smile, ^_^, hatsune miku (vocaloid)"
    assert data["blue"]["tags"] == "blue sky, smile, hatsune miku (vocaloid), some char"
    assert all(entry["train_resolution"] == [64, 64] and isinstance(entry["caption"], str) for entry in data.values())

    trainer = make_trainer([
        "--pretrained_model_name_or_path", "tiny:sd1", "--in_json", final, "--train_data_dir", root,
        "--resolution", "64,64", "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "128",
        "--cache_latents", "--cache_latents_to_disk", "--max_data_loader_n_workers", "0",
        "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
        "--learning_rate", "1e-3", "--max_train_steps", "1", "--seed", "1",
        "--output_dir", str(tmp_path / "out"), "--output_name", "lora"])
    trainer.run()
    assert os.path.isfile(tmp_path / "out" / "lora.safetensors")


def test_every_finetune_flag_is_documented():
    import argparse
    import re

    with open("docs/finetune_tools.md", encoding="utf-8") as f:
        text = f.read()
    documented = set(re.findall(r"`(--[a-z0-9_]+)", text))
    missing = []
    for module in (merge_captions_to_metadata, merge_dd_tags_to_metadata, clean_captions_and_tags,
                   prepare_buckets_latents, make_captions, tag_images_by_wd14_tagger):
        for action in module.build_parser()._actions:
            if not action.option_strings or action.dest == "help" or action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag not in documented and not re.search(re.escape(flag) + r"\b", text):
                    missing.append(f"{module.__name__}: {flag}")
    assert missing == []
