import json
import os

import numpy as np
import pytest
from PIL import Image

import library.data.image_scan as image_scan
from library.data.image_scan import read_image_size, scan_image_sizes
from library.data.images import load_image


def _write(path, size, orientation=None, fmt=None):
    img = Image.fromarray(np.full((size[1], size[0], 3), 90, np.uint8))
    kwargs = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    img.save(path, format=fmt, **kwargs)
    return str(path)


@pytest.fixture
def folder(tmp_path):
    files = {
        "wide.png": _write(tmp_path / "wide.png", (40, 20)),
        "rot6.jpg": _write(tmp_path / "rot6.jpg", (40, 20), orientation=6),
        "rot3.jpg": _write(tmp_path / "rot3.jpg", (40, 20), orientation=3),
        "rot8.webp": _write(tmp_path / "rot8.webp", (30, 10), orientation=8),
        "rot5.png": _write(tmp_path / "rot5.png", (16, 8), orientation=5),
    }
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("hello")
    files["empty.png"] = str(tmp_path / "empty.png")
    files["text.jpg"] = str(tmp_path / "text.jpg")
    files["missing.png"] = str(tmp_path / "missing.png")
    return files


def test_sizes_with_exif_rotation_and_problems(folder, tmp_path):
    result = scan_image_sizes(list(folder.values()), str(tmp_path / "meta.json"), progress=False)
    assert result.sizes == {
        folder["wide.png"]: (40, 20),
        folder["rot6.jpg"]: (20, 40),
        folder["rot3.jpg"]: (40, 20),
        folder["rot8.webp"]: (10, 30),
        folder["rot5.png"]: (8, 16),
    }
    assert result.problems == {
        folder["empty.png"]: "empty file (0 bytes)",
        folder["text.jpg"]: "not a recognised image format (unreadable header)",
        folder["missing.png"]: "file not found",
    }
    assert result.from_cache == 0


def test_scanned_size_equals_loaded_size(folder):
    for name in ("wide.png", "rot6.jpg", "rot8.webp", "rot5.png"):
        rgb, _ = load_image(folder[name])
        assert read_image_size(folder[name]) == (rgb.shape[1], rgb.shape[0])


def test_warm_scan_opens_no_file_and_a_changed_file_is_rescanned(folder, tmp_path, monkeypatch):
    cache = str(tmp_path / "meta.json")
    paths = list(folder.values())
    first = scan_image_sizes(paths, cache, progress=False)

    data = json.load(open(cache))
    assert data["version"] == image_scan.CACHE_VERSION == 2  # 2: entries are decode-checked
    entry = data["entries"][os.path.abspath(folder["rot6.jpg"])]
    assert (entry["width"], entry["height"]) == (20, 40)
    assert data["entries"][os.path.abspath(folder["empty.png"])]["problem"] == "empty file (0 bytes)"
    assert os.path.abspath(folder["missing.png"]) not in data["entries"]

    def no_open(*args, **kwargs):
        raise AssertionError("the warm scan opened an image")

    monkeypatch.setattr(image_scan.Image, "open", no_open)
    mtime_before = os.stat(cache).st_mtime_ns
    second = scan_image_sizes(paths, cache, progress=False)
    assert second.sizes == first.sizes and second.problems == first.problems
    assert second.from_cache == 7
    assert os.stat(cache).st_mtime_ns == mtime_before  # nothing changed, nothing rewritten
    monkeypatch.undo()

    # Rewrite one file with a new size and a new mtime: only it is opened again.
    _write(folder["wide.png"], (24, 64))
    st = os.stat(folder["wide.png"])
    os.utime(folder["wide.png"], ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    opened = []
    real_open = Image.open

    def counting_open(path, *args, **kwargs):
        opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(image_scan.Image, "open", counting_open)
    third = scan_image_sizes(paths, cache, progress=False)
    assert opened == [folder["wide.png"]]
    assert third.sizes[folder["wide.png"]] == (24, 64)
    assert third.from_cache == 6


def test_corrupt_cache_is_ignored_and_replaced(folder, tmp_path):
    cache = tmp_path / "meta.json"
    cache.write_text("{not json")
    result = scan_image_sizes([folder["wide.png"]], str(cache), progress=False)
    assert result.sizes == {folder["wide.png"]: (40, 20)}
    assert json.loads(cache.read_text())["entries"][os.path.abspath(folder["wide.png"])]["width"] == 40
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_no_cache_path(folder):
    result = scan_image_sizes([folder["rot6.jpg"]], None, progress=False)
    assert result.sizes == {folder["rot6.jpg"]: (20, 40)}


def test_other_entries_in_the_cache_are_kept(folder, tmp_path):
    cache = str(tmp_path / "meta.json")
    scan_image_sizes([folder["wide.png"]], cache, progress=False)
    scan_image_sizes([folder["rot3.jpg"]], cache, progress=False)
    entries = json.load(open(cache))["entries"]
    assert sorted(entries) == sorted([os.path.abspath(folder["wide.png"]), os.path.abspath(folder["rot3.jpg"])])


def test_many_files_show_progress(tmp_path, capsys):
    path = _write(tmp_path / "one.png", (8, 8))
    paths = [path]
    for i in range(1, image_scan.PROGRESS_MIN_FILES):
        copy = tmp_path / f"{i}.png"
        copy.write_bytes(open(path, "rb").read())
        paths.append(str(copy))
    result = scan_image_sizes(paths + [path], None, progress=True)  # a duplicate is reported once
    assert len(result.sizes) == image_scan.PROGRESS_MIN_FILES
    assert set(result.sizes.values()) == {(8, 8)}
    assert "checking images" in capsys.readouterr().err
