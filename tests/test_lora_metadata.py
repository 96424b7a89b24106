"""library/core/metadata.py and library/cli/network.py: ss_* keys, modelspec, hashes, flags."""

import argparse
import datetime
import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from library.cli.network import (
    add_network_arguments,
    network_args_to_dict,
    network_options_from_args,
)
from library.core.errors import ConfigError
from library.core import metadata as M
from library.train.adapters.network_kinds import import_network_module
from library.train.settings import NetworkOptions

TINY_SD = {"a.lora_down.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a.alpha": torch.tensor(1.0)}
# sha256 of the tensor-data section: safetensors lays out "a.alpha" then "a.lora_down.weight"
TINY_MODEL_HASH = "5f0696bb352d9c66b57b77fc9e311dc32c1fabc9aabcb771ffa5b70bc9902f9d"


def test_sshs_hashes_of_a_known_state_dict():
    data = torch.tensor(1.0).numpy().tobytes() + torch.arange(6, dtype=torch.float32).numpy().tobytes()
    assert hashlib.sha256(data).hexdigest() == TINY_MODEL_HASH  # independent computation
    md = M.with_hashes(TINY_SD, {"ss_network_dim": "2", "modelspec.sai_model_spec": "1.0.1"})
    assert md["sshs_model_hash"] == TINY_MODEL_HASH
    # fewer than 0x100000 bytes: the legacy recipe hashes an empty slice
    assert md["sshs_legacy_hash"] == "e3b0c442"
    assert md["modelspec.hash_sha256"] == "0x" + TINY_MODEL_HASH
    assert "modelspec.hash_sha256" not in M.with_hashes(TINY_SD, {"ss_x": "1"})


def test_saved_file_carries_hashes_matching_its_own_tensor_bytes(tmp_path):
    path = str(tmp_path / "a.safetensors")
    M.save_lora_state_dict(path, TINY_SD, {"ss_network_dim": "2", "modelspec.sai_model_spec": "1.0.1"})
    with open(path, "rb") as f:
        blob = f.read()
    header_len = int.from_bytes(blob[:8], "little")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.hash_sha256"] == "0x" + hashlib.sha256(blob[8 + header_len:]).hexdigest()
    assert set(meta) == {"ss_network_dim", "modelspec.sai_model_spec", "modelspec.hash_sha256",
                         "sshs_model_hash", "sshs_legacy_hash"}


RUN = {
    "output_name": "cat", "learning_rate": 1e-4, "unet_lr": None, "text_encoder_lr": [5e-5, 1e-5],
    "network_module": "networks.lora", "network_dim": 8, "network_alpha": 4.0, "v2": False, "full_fp16": None,
    "seed": 42, "max_train_steps": 100, "face_crop_aug_range": None,
    "session_id": 1234, "training_started_at": 1700000000.5, "steps": 100, "epoch": 2, "num_epochs": 2,
    "optimizer": "torch.optim.adamw.AdamW(weight_decay=0.01)", "base_model_version": "sd_v1",
    "sd_model_name": "model.safetensors", "sd_model_hash": "abcd1234", "new_sd_model_hash": "ff" * 32,
    "network_args": {"conv_dim": "4"},
    "dataset_metadata": {"ss_datasets": [{"is_dreambooth": True}], "ss_tag_frequency": {},
                         "ss_dataset_dirs": '{"10_cat": {"n_repeats": 10, "img_count": 3}}'},
}


def test_training_metadata_golden_keys_and_values():
    md = M.training_metadata(RUN)
    mirrored = {f"ss_{flag}" for flag in M.MIRRORED_FLAGS}
    run_facts = {"ss_session_id", "ss_training_started_at", "ss_steps", "ss_epoch", "ss_num_epochs", "ss_optimizer",
                 "ss_base_model_version", "ss_sd_model_name", "ss_sd_model_hash", "ss_new_sd_model_hash"}
    assert set(md) == mirrored | run_facts | {"ss_debiased_estimation", "ss_text_encoder_lr", "ss_network_args",
                                              "ss_datasets", "ss_tag_frequency", "ss_dataset_dirs"}
    assert len(mirrored) == 49 and len(md) == 65
    assert all(isinstance(v, str) for v in md.values())
    assert md["ss_learning_rate"] == "0.0001" and md["ss_unet_lr"] == "None"
    assert md["ss_text_encoder_lr"] == "5e-05"  # the first of the list, as sd-scripts records it
    assert md["ss_network_dim"] == "8" and md["ss_network_alpha"] == "4.0"
    assert md["ss_v2"] == "False" and md["ss_full_fp16"] == "False" and md["ss_debiased_estimation"] == "False"
    assert md["ss_network_args"] == '{"conv_dim": "4"}'
    assert json.loads(md["ss_datasets"]) == [{"is_dreambooth": True}]
    assert md["ss_dataset_dirs"] == '{"10_cat": {"n_repeats": 10, "img_count": 3}}'
    assert md["ss_training_started_at"] == "1700000000.5"
    assert md["ss_optimizer"] == "torch.optim.adamw.AdamW(weight_decay=0.01)"


def test_training_metadata_flat_dataset_keys_without_dataset_config():
    run = dict(RUN, dataset_metadata={"ss_bucket_info": "{}"}, train_batch_size=2, resolution="512,512")
    md = M.training_metadata(run)
    flat = {f"ss_{k}" for k in M.FLAT_DATASET_FLAGS}
    assert flat <= set(md) and "ss_datasets" not in md
    assert md["ss_batch_size_per_device"] == "2" and md["ss_resolution"] == "512,512" and md["ss_flip_aug"] == "False"
    assert md["ss_bucket_info"] == "{}"


def test_no_metadata_keeps_the_minimum():
    md = M.training_metadata(dict(RUN, no_metadata=True))
    assert md == {"ss_v2": "False", "ss_base_model_version": "sd_v1", "ss_network_module": "networks.lora",
                  "ss_network_dim": "8", "ss_network_alpha": "4.0", "ss_network_args": '{"conv_dim": "4"}'}


def test_modelspec_strings():
    md = M.modelspec_metadata("stable-diffusion-v1", "diffusers", "cat", (512, 768), prediction_type="epsilon",
                              timestep_range=(0, 999), encoder_layer=2,
                              date=datetime.datetime(2024, 5, 1, 12, 30, 15, 999),
                              extra={"metadata_author": "me", "metadata_tags": "cat,pet", "metadata_license": None})
    assert md == {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": "stable-diffusion-v1/lora",
        "modelspec.implementation": "diffusers",
        "modelspec.title": "cat",
        "modelspec.resolution": "512x768",
        "modelspec.date": "2024-05-01T12:30:15",
        "modelspec.implementation_version": f"{M.TOOLKIT_NAME}/{M.TOOLKIT_VERSION}",
        "modelspec.prediction_type": "epsilon",
        "modelspec.timestep_range": "0,999",
        "modelspec.encoder_layer": "2",
        "modelspec.author": "me",
        "modelspec.tags": "cat,pet",
    }
    short = M.modelspec_metadata("stable-diffusion-v2-768-v", "diffusers", "x", 768, date="2024-01-02",
                                 is_lora=False, extra={"metadata_title": "Nice title"})
    assert short["modelspec.architecture"] == "stable-diffusion-v2-768-v"
    assert short["modelspec.title"] == "Nice title" and short["modelspec.resolution"] == "768x768"
    assert "modelspec.prediction_type" not in short and short["modelspec.date"] == "2024-01-02"


# --- flags ---------------------------------------------------------------------------------------
def _parse(argv):
    parser = argparse.ArgumentParser()
    add_network_arguments(parser)
    return parser.parse_args(argv)


def test_network_flag_defaults_and_options():
    ns = _parse([])
    assert (ns.network_module, ns.network_dim, ns.network_alpha, ns.network_multiplier) == ("networks.lora", 4, 1, 1.0)
    assert network_options_from_args(ns) == NetworkOptions(
        metadata={"metadata_title": None, "metadata_author": None, "metadata_description": None,
                  "metadata_license": None, "metadata_tags": None, "metadata_usage_hint": None,
                  "metadata_thumbnail": None, "metadata_merged_from": None, "metadata_trigger_phrase": None,
                  "metadata_preprocessor": None, "metadata_is_negative_embedding": None})
    opts = network_options_from_args(_parse([
        "--network_dim", "16", "--network_args", "conv_dim=4", "down_lr_weight=1,1,0", "--text_encoder_lr", "1e-5",
        "--network_train_unet_only", "--base_weights", "a.safetensors", "b.safetensors",
        "--metadata_author", "me"]))
    assert opts.network_dim == 16 and opts.network_args == {"conv_dim": "4", "down_lr_weight": "1,1,0"}
    assert opts.text_encoder_lr == [1e-5] and (opts.train_unet, opts.train_text_encoder) == (True, False)
    assert opts.base_weights_multiplier == [1.0, 1.0] and opts.metadata["metadata_author"] == "me"


@pytest.mark.parametrize("argv, message", [
    (["--network_args", "conv_dim"], "--network_args 'conv_dim': expected key=value"),
    (["--dim_from_weights"], "--dim_from_weights: expected --network_weights to be given too"),
    (["--base_weights", "a", "--base_weights_multiplier", "1", "2"],
     "--base_weights_multiplier: expected 1 values (one per --base_weights), got 2"),
    (["--network_train_unet_only", "--network_train_text_encoder_only"],
     "--network_train_unet_only and --network_train_text_encoder_only: expected at most one"),
])
def test_bad_network_flags(argv, message):
    with pytest.raises(ConfigError) as e:
        network_options_from_args(_parse(argv))
    assert str(e.value) == message


def test_network_args_to_dict_keeps_strings():
    assert network_args_to_dict(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}


def test_import_network_module(monkeypatch):
    import sys

    assert hasattr(import_network_module("networks.lora"), "create_network_from_weights")
    # As if lycoris-lora were not installed (a None entry makes the import fail).
    monkeypatch.setitem(sys.modules, "lycoris", None)
    monkeypatch.delitem(sys.modules, "lycoris.kohya", raising=False)
    with pytest.raises(ConfigError, match=r"^--network_module lycoris.kohya: not installed; pip install lycoris-lora "
                                         r"\(or, in this repository: pip install \.\[lycoris\]\)$"):
        import_network_module("lycoris.kohya")
    with pytest.raises(ConfigError, match="expected a module defining create_network"):
        import_network_module("networks.lora_math")


def test_modelspec_optional_fields_as_sd_scripts_writes_them(tmp_path):
    """--metadata_usage_hint / _thumbnail / _merged_from / _trigger_phrase / _preprocessor /
    _is_negative_embedding become modelspec.<name> (sd-scripts' ModelSpecMetadata.from_args); a thumbnail file is
    written as a base64 data: URL with its MIME type, as sd-scripts' file_to_data_url does."""
    import base64

    from library.core.metadata import modelspec_metadata

    png = tmp_path / "thumb.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    extra = {"metadata_usage_hint": "use 'sks dog'", "metadata_thumbnail": str(png), "metadata_merged_from": "a, b",
             "metadata_trigger_phrase": "sks dog", "metadata_preprocessor": "canny",
             "metadata_is_negative_embedding": "false"}
    md = modelspec_metadata("stable-diffusion-v1", "diffusers", "t", 512, extra=extra)
    assert {k: md[k] for k in md if k.split(".")[1] in {"usage_hint", "thumbnail", "merged_from", "trigger_phrase",
                                                       "preprocessor", "is_negative_embedding"}} == {
        "modelspec.usage_hint": "use 'sks dog'",
        "modelspec.thumbnail": "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode(),
        "modelspec.merged_from": "a, b", "modelspec.trigger_phrase": "sks dog", "modelspec.preprocessor": "canny",
        "modelspec.is_negative_embedding": "false"}
    assert modelspec_metadata("a", "b", "t", 512, extra={"metadata_thumbnail": "data:x"})["modelspec.thumbnail"] == "data:x"


def test_missing_thumbnail_file_stops_before_training(tmp_path):
    from library.cli.fine_tune import metadata_from_args

    ns = _parse(["--metadata_thumbnail", str(tmp_path / "nope.png")])
    with pytest.raises(ConfigError, match=r"^--metadata_thumbnail .*nope.png: file not found; expected an image file"):
        metadata_from_args(ns)
