"""--log_with wandb logs (offline here) the same scalars as TensorBoard, with sd-scripts'
--wandb_run_name, --wandb_api_key and --log_tracker_config."""

import glob
import json
import os
import struct
import time

import pytest

from library.cli.entry import run_training
from tests.train_helpers import base_args, make_dataset

wandb = pytest.importorskip("wandb")


def _wandb_records(path):
    """The records of a wandb transaction log (.wandb: LevelDB log blocks of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    blob, pos, out, buf = open(path, "rb").read(), 7, [], b""
    while pos + 7 <= len(blob):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", blob[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf += blob[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last fragment
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def _tensorboard_tags(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return set(acc.Tags()["scalars"])


def test_log_with_all_writes_wandb_offline_with_tensorboard_names(tmp_path, monkeypatch, capsys):
    """--log_with all: wandb (WANDB_MODE=offline) gets every scalar TensorBoard gets, under the
    same names, in a run named by --wandb_run_name with --log_tracker_config's [wandb] settings; the API key
    is used and never written to the saved config."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    os.makedirs(tmp_path / "wb")
    (tmp_path / "trackers.toml").write_text('[wandb]\ntags = ["nightly"]\nnotes = "flag audit"\n')
    data = make_dataset(str(tmp_path), n=2)
    out, logs = str(tmp_path / "out"), str(tmp_path / "logs")
    argv = base_args(data, out, steps=3, extra=[
        "--log_with", "all", "--logging_dir", logs, "--log_tracker_name", "proj", "--wandb_run_name", "myrun",
        "--wandb_api_key", "k" * 40, "--log_tracker_config", str(tmp_path / "trackers.toml"), "--log_config"])
    assert run_training("sd", "t", argv) == 0, capsys.readouterr().err
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # set from --wandb_api_key during the run

    # wandb's offline writer (its own service process) may still be flushing the log after finish() returns on a
    # loaded machine (seen in CI: the file without its run record yet), so wait for the run record a while
    deadline, records = time.monotonic() + 60, []
    while True:
        runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(runs) <= 1
        records = _wandb_records(runs[0]) if runs else []
        kinds = {r.WhichOneof("record_type") for r in records}
        if {"run", "history", "exit"} <= kinds or time.monotonic() > deadline:  # "exit": finish() was written
            break
        time.sleep(0.5)
    assert len(runs) == 1
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.display_name, run.project, list(run.tags), run.notes) == ("myrun", "proj", ["nightly"], "flag audit")
    config = {i.key: i.value_json for r in records if r.WhichOneof("record_type") == "config" for i in r.config.update}
    config.update({i.key: i.value_json for i in run.config.update})
    assert json.loads(config["learning_rate"]) == 1e-3 and json.loads(config["network_dim"]) == 4  # --log_config
    assert "wandb_api_key" not in config and "k" * 40 not in str(config)
    history = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item} for r in records if r.WhichOneof("record_type") == "history"]
    wandb_keys = {k for h in history for k in h if not k.startswith("_")}
    tb_dir = glob.glob(os.path.join(logs, "*", "proj"))[0]
    assert wandb_keys == _tensorboard_tags(tb_dir)
    assert {"loss/current", "loss/average", "lr/unet"} <= wandb_keys
    assert sorted(int(h["_step"]) for h in history if "loss/current" in h) == [1, 2, 3]
    saved = open(os.path.join(out, "lora_config.toml")).read()
    assert "wandb_run_name" in saved and "wandb_api_key" not in saved


@pytest.mark.parametrize("extra,message", [
    (["--log_with", "wandb"], "--log_with wandb needs the wandb package: pip install wandb"),
    (["--wandb_run_name", "r"], "--wandb_run_name: only used with --log_with wandb or all"),
    (["--log_with", "tensorboard"], "--log_with tensorboard: needs --logging_dir"),
    (["--log_with", "wandb", "--log_tracker_config", "missing.toml"], "--log_tracker_config missing.toml: file not found"),
])
def test_tracker_flags_refused_before_anything_loads(tmp_path, capsys, monkeypatch, extra, message):
    """A tracker that cannot run stops the run with one line before the scan, instead of logging nothing."""
    from library.cli import training

    if "needs the wandb package" in message:
        monkeypatch.setattr(training, "wandb_installed", lambda: False)
    argv = ["--pretrained_model_name_or_path", "tiny:sd1", "--output_dir", str(tmp_path / "o"),
            "--train_data_dir", str(tmp_path / "missing")] + extra
    assert run_training("sd", "t", argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err, err
