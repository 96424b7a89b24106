"""--in_json / metadata_file `train_resolution`: the bucket prepare_buckets_latents chose is the image's bucket."""

import json
import os

import pytest
from PIL import Image

from library.core.errors import DataError
from library.data import DataFamilyInfo, build_training_data
from library.data.options import DataOptions

FAMILY = DataFamilyInfo(bucket_reso_multiple=64, latent_cache_arch="_sd", vae_scale_factor=8, latent_channels=4)


def _dataset(tmp_path, wide_entry: dict, **kw):
    root = tmp_path / "imgs"
    root.mkdir()
    Image.new("RGB", (200, 100), (200, 20, 20)).save(root / "wide.png")
    Image.new("RGB", (200, 100), (20, 200, 20)).save(root / "wide2.png")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"wide": {"caption": "red", **wide_entry}, "wide2": {"caption": "green"}}))
    base = dict(in_json=str(meta), train_data_dir=str(root), resolution="128", enable_bucket=True, min_bucket_reso=64,
                max_bucket_reso=256, seed=1)
    base.update(kw)
    return build_training_data(DataOptions(**base), FAMILY), str(meta), str(root)


def _placements(data) -> dict[str, tuple]:
    group = data.groups[0]
    return {os.path.basename(data.samples[i].path): (p.bucket, p.resized) for i, p in group.placements.items()}


def test_train_resolution_is_the_bucket_and_the_image_covers_it(tmp_path):
    data, _, _ = _dataset(tmp_path, {"train_resolution": [192, 64]})
    # wide.png (2:1) has the file's bucket, resized to cover it (scale 192/200); wide2.png, without one, gets the
    # computed bucket: at 128x128 with steps of 64, 2:1 is as far from 3:1 as from 1:1 and the first, 128x128, wins.
    assert _placements(data) == {"wide.png": ((192, 64), (192, 96)), "wide2.png": ((128, 128), (256, 128))}
    assert data.groups[0].bucket_info["buckets"] == {0: {"resolution": [128, 128], "count": 1},
                                                     1: {"resolution": [192, 64], "count": 1}}


def test_without_train_resolution_the_bucket_is_computed(tmp_path):
    data, _, _ = _dataset(tmp_path, {})
    assert _placements(data)["wide.png"] == ((128, 128), (256, 128))


@pytest.mark.parametrize("value,why", [
    ([96, 64], "expected multiples of bucket_reso_steps 64"),
    ([192, 128], ("expected an area of at most 128x128 (the resolution); prepare_buckets_latents was run with a "
                  "larger --max_resolution")),
    ([320, 64], "expected sides between min_bucket_reso 64 and max_bucket_reso 256"),
])
def test_a_train_resolution_outside_the_bucket_rules_is_one_line_naming_image_and_value(tmp_path, value, why):
    with pytest.raises(DataError) as e:
        _dataset(tmp_path, {"train_resolution": value})
    meta, image = str(tmp_path / "meta.json"), str(tmp_path / "imgs" / "wide.png")
    assert str(e.value) == f"{image}: train_resolution [{value[0]}, {value[1]}] in {meta}: {why}"


def test_a_malformed_train_resolution_and_one_without_buckets(tmp_path):
    with pytest.raises(DataError) as e:
        _dataset(tmp_path, {"train_resolution": [192, "64"]})
    assert str(e.value) == (f"{tmp_path / 'meta.json'}: wide: train_resolution: expected [width, height] "
                            "(two integers >= 1), got [192, \"64\"]")
    (tmp_path / "b").mkdir()
    with pytest.raises(DataError) as e:  # a fixed resolution: the file's bucket must be it
        _dataset(tmp_path / "b", {"train_resolution": [192, 64]}, enable_bucket=False, resolution="200,100")
    assert str(e.value) == (f"{tmp_path / 'b' / 'imgs' / 'wide.png'}: train_resolution [192, 64] in "
                            f"{tmp_path / 'b' / 'meta.json'}: expected the resolution 200x100 without enable_bucket "
                            "(add --enable_bucket to use the file's buckets)")
