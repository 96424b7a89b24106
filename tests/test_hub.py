"""The Hugging Face Hub flags, against a stand-in Hub on 127.0.0.1 (tests/hub_standin.py) reached
through $HF_ENDPOINT. Exercised: create_repo, upload_file / upload_folder as inline ("regular") commits, a refused
commit, and snapshot_download of a state folder for --resume_from_huggingface. Not exercised: LFS / Xet transfers
of large files, authentication (the stand-in accepts any token), the real Hub's rate limits."""

import logging
import os

import pytest
from safetensors.torch import load_file

from library.core.errors import ConfigError
from tests.hub_standin import HubStandIn
from tests.train_helpers import base_args, make_dataset, make_trainer


def _online_to(monkeypatch, tmp_path, stand_in):
    """huggingface_hub pointed at the stand-in; tests/conftest.py keeps it offline otherwise."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with HubStandIn() as stand_in:
        _online_to(monkeypatch, tmp_path, stand_in)
        yield stand_in


def test_run_uploads_each_saved_model_and_state(hub, tmp_path):
    data = make_dataset(str(tmp_path / "data"))
    out = tmp_path / "out"
    trainer = make_trainer(base_args(data, str(out), steps=2, extra=[
        "--save_every_n_steps", "1", "--save_state", "--huggingface_repo_id", "me/my-lora",
        "--huggingface_path_in_repo", "runs/a", "--save_state_to_huggingface", "--async_upload",
        "--huggingface_token", "hf_x"]))
    trainer.run()
    assert hub.created == [{"name": "my-lora", "organization": "me", "visibility": "private"}]
    uploaded = sorted(path for commit in hub.commits for path in commit["files"])
    assert [p for p in uploaded if p.endswith(".safetensors") and "state" not in p] == [
        "runs/a/lora-step00000001.safetensors", "runs/a/lora.safetensors"]
    states = sorted({p.split("/")[2] for p in uploaded if "state" in p.split("/")[2]})
    assert states == ["lora-state", "lora-step00000001-state"]
    local = (out / "lora.safetensors").read_bytes()
    assert hub.files[("me/my-lora", "runs/a/lora.safetensors")] == local  # the same bytes as the local file
    state_files = sorted(os.listdir(out / "lora-state"))
    assert sorted(p.split("/", 3)[3] for p in uploaded if p.startswith("runs/a/lora-state/")) == state_files

    # --resume_from_huggingface: the uploaded step-1 state, downloaded, goes on to step 2 as the local one does
    resumed = make_trainer(base_args(data, str(tmp_path / "out2"), steps=2, extra=[
        "--resume", "me/my-lora/runs/a/lora-step00000001-state", "--resume_from_huggingface"]))
    resumed.run()
    local_resumed = make_trainer(base_args(data, str(tmp_path / "out3"), steps=2, extra=[
        "--resume", str(out / "lora-step00000001-state")]))
    local_resumed.run()
    a, b = load_file(str(tmp_path / "out2" / "lora.safetensors")), load_file(str(tmp_path / "out3" / "lora.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_failed_upload_warns_and_keeps_training(monkeypatch, tmp_path, caplog):
    with HubStandIn(fail_commits=True) as hub:
        _online_to(monkeypatch, tmp_path, hub)
        data = make_dataset(str(tmp_path / "data"))
        out = tmp_path / "out"
        caplog.set_level(logging.WARNING, logger="library.train.hub")
        trainer = make_trainer(base_args(data, str(out), steps=2, extra=[
            "--save_every_n_steps", "1", "--huggingface_repo_id", "me/my-lora"]))
        trainer.run()
    assert trainer.run_state.progress.global_step == 2
    assert sorted(os.listdir(out)) == ["lora-step00000001.safetensors", "lora.safetensors"]
    assert hub.commits == [] and trainer.saver.uploader.failures == [
        str(out / "lora-step00000001.safetensors"), str(out / "lora.safetensors")]
    warnings = [r.message for r in caplog.records if "failed, the local file is kept" in r.message]
    assert len(warnings) == 2


@pytest.mark.parametrize("extra,message", [
    (["--save_state_to_huggingface"], "--save_state_to_huggingface: only used with --huggingface_repo_id"),
    (["--huggingface_repo_id", "nameonly"], "--huggingface_repo_id nameonly: expected <owner>/<name>"),
    (["--huggingface_repo_id", "a/b", "--save_state_to_huggingface"],
     "--save_state_to_huggingface: no state is saved; add --save_state or --save_state_on_train_end"),
    (["--resume_from_huggingface"], "--resume_from_huggingface: needs --resume <owner>/<repo>/<path>[:<revision>[:<type>]]"),
    (["--resume_from_huggingface", "--resume", "a/b"],
     "--resume a/b: expected <owner>/<repo>/<path in repo>[:<revision>[:<repo type>]], got 'a/b'"),
])
def test_hub_flag_mistakes_are_one_line(tmp_path, extra, message):
    with pytest.raises(ConfigError) as e:
        make_trainer(base_args(str(tmp_path), str(tmp_path / "o"), extra=extra))
    assert str(e.value) == message


def test_hub_state_spec_as_sd_scripts():
    from library.train.hub import parse_hub_state

    assert parse_hub_state("me/r/states/last-state") == ("me/r", "states/last-state", None, "model")
    assert parse_hub_state("me/r/s:v1") == ("me/r", "s", "v1", "model")
    assert parse_hub_state("me/r/s:v1:dataset") == ("me/r", "s", "v1", "dataset")


def test_token_is_never_written_to_the_saved_config(tmp_path):
    from library.cli.config_file import parse_with_config_file, write_config_file
    from library.cli.entry import build_parser
    from library.families import get_family

    parser = build_parser("t", get_family("sd"))
    ns = parse_with_config_file(parser, base_args(str(tmp_path), str(tmp_path / "o"), extra=[
        "--huggingface_repo_id", "me/r", "--huggingface_token", "hf_secret"]))
    path = tmp_path / "c.toml"
    write_config_file(ns, str(path), parser)
    text = path.read_text()
    assert 'huggingface_repo_id = "me/r"' in text and "hf_secret" not in text and "huggingface_token" not in text
