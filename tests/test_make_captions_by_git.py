"""finetune/make_captions_by_git.py on a tiny GitForCausalLM built from config (random weights, save_pretrained)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from PIL import Image

from finetune import make_captions_by_git

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "square", "picture", "of", "the", "green",
         "blue", "dog", "cat", "sign", "with", "words", "on", "it"]


@pytest.fixture(scope="module")
def tiny_git(tmp_path_factory) -> str:
    from transformers import BertTokenizer, CLIPImageProcessor, GitConfig, GitForCausalLM, GitProcessor

    folder = str(tmp_path_factory.mktemp("git"))
    vocab = os.path.join(folder, "vocab.txt")
    with open(vocab, "w", encoding="utf-8") as f:
        f.write("\n".join(WORDS) + "\n")
    processor = GitProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                crop_size={"height": 32, "width": 32}),
                             tokenizer=BertTokenizer(vocab))
    config = GitConfig(vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=32, image_size=32, patch_size=16),
                       vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
                       eos_token_id=3)
    torch.manual_seed(0)
    model_dir = os.path.join(folder, "model")
    GitForCausalLM(config).save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    return model_dir


def _image(path: str, size, color) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def _expected(model_dir: str, paths: list[str], max_length: int) -> list[str]:
    """Captions by transformers itself, one image at a time."""
    from transformers import AutoProcessor, GitForCausalLM

    model = GitForCausalLM.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    out = []
    for path in paths:
        with Image.open(path) as img:
            pixels = processor(images=[img.convert("RGB")], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            ids = model.generate(pixel_values=pixels, max_length=max_length)
        out.append(processor.batch_decode(ids, skip_special_tokens=True)[0].strip())
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_captions_equal_transformers_generate_and_a_rerun_resumes(tiny_git, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="finetune")
    root = str(tmp_path / "imgs")
    paths = [_image(os.path.join(root, "a.png"), (40, 30), (200, 20, 20)),
             _image(os.path.join(root, "sub", "b.jpg"), (30, 40), (20, 20, 200)),
             _image(os.path.join(root, "c.png"), (32, 32), (20, 200, 20))]
    with open(os.path.join(root, "bad.png"), "w") as f:
        f.write("not an image")
    with open(os.path.join(root, "keep.caption"), "w", encoding="utf-8") as f:
        f.write("mine\n")
    _image(os.path.join(root, "keep.png"), (32, 32), (0, 0, 0))
    flags = ["--model_id", tiny_git, "--max_length", "8", "--batch_size", "2", "--recursive"]
    assert make_captions_by_git.main([root] + flags) == 0
    expected = _expected(tiny_git, paths, 8)
    # Batches of 2 against one image at a time: other float sums, but the words are argmaxes, and the smallest
    # gap between the two best logits of any step measured 5.5e-3, far above float32 rounding: exact text.
    assert [_read(os.path.splitext(p)[0] + ".caption") for p in paths] == [e + "\n" for e in expected]
    assert any(expected) and _read(os.path.join(root, "keep.caption")) == "mine\n"  # skipped: it had a caption
    assert "1 images could not be read and were skipped" in caplog.text

    # A rerun captions only what is missing; --overwrite captions everything again.
    os.remove(os.path.join(root, "c.caption"))
    mtime = os.stat(os.path.join(root, "a.caption")).st_mtime_ns
    caplog.clear()
    assert make_captions_by_git.main([root] + flags) == 0
    assert "3 images already have a .caption file and are skipped" in caplog.text
    assert "captioning 2 images" in caplog.text  # c.png (removed) and the unreadable bad.png
    assert os.stat(os.path.join(root, "a.caption")).st_mtime_ns == mtime
    assert _read(os.path.join(root, "c.caption")) == expected[2] + "\n"
    assert make_captions_by_git.main([root, "--model_id", tiny_git, "--max_length", "8", "--overwrite",
                                      "--caption_extension", "txt"]) == 0
    assert sorted(n for n in os.listdir(root) if n.endswith(".txt")) == ["a.txt", "c.txt", "keep.txt"]


def test_remove_words_drops_text_read_into_the_image():
    r = make_captions_by_git.remove_words
    assert r('a man in a shirt with the words "hello world" on his shirt') == "a man in a shirt"
    assert r("a red sign that says stop on it") == "a red sign"
    assert r("a bus with the number 12 on the front") == "a bus"
    assert r("a mug and the word coffee on it") == "a mug"
    assert r("a poster with the name 'bob' in the corner") == "a poster"
    assert r("a red square on a table") == "a red square on a table"


def test_missing_weights_is_one_line(tmp_path, capsys):
    root = str(tmp_path / "imgs")
    _image(os.path.join(root, "a.png"), (8, 8), (0, 0, 0))
    expected = ("expected a local transformers GIT folder (config.json, weights, preprocessor and tokenizer files, "
                "as save_pretrained writes them) or a hub id already in the Hugging Face cache; weights are not "
                "downloaded here")
    os.makedirs(tmp_path / "empty")
    assert make_captions_by_git.main([root, "--model_id", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --model_id: {tmp_path / 'empty' / 'config.json'} not found: {expected}\n"
    assert make_captions_by_git.main([root, "--model_id", "someone/not-downloaded-git"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --model_id: cannot load someone/not-downloaded-git: ")
    assert err.endswith(f"; {expected}\n")
