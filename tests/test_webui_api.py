"""The web UI's HTTP API (issue 14), through FastAPI's TestClient: every endpoint, the token, path traversal,
the dataset TOML through the trainer's own --check_config, Performance / Diagnostics availability and refused
saves, GPU choice and strategies through tools/make_accelerate_config.py, the settings history, and a real tiny
job trained through the UI's own runner: stopped mid-way, resumed with auto-resume, the server restarted
(re-attach) while it runs, and finished."""

from __future__ import annotations

import os
import time

import pytest
import toml

fastapi = pytest.importorskip("fastapi", reason="the web UI needs fastapi: pip install -r requirements-dev.txt")
from fastapi.testclient import TestClient  # noqa: E402

from webui import logs  # noqa: E402
from webui.app import create_app  # noqa: E402
from webui.jobfiles import error_field, one_line_error  # noqa: E402
from webui.server import is_loopback, main  # noqa: E402


@pytest.fixture
def jobs_dir(tmp_path):
    return str(tmp_path / "jobs")


@pytest.fixture
def client(jobs_dir):
    return TestClient(create_app(jobs_dir, stop_timeout=30))


def _create(client, **body):
    r = client.post("/api/jobs", json={"template": "tiny_sd1_lora", **body})
    assert r.status_code == 201, r.text
    return r.json()


def test_token_is_required_everywhere_when_given(jobs_dir):
    c = TestClient(create_app(jobs_dir, token="s3cret"))
    for path in ("/", "/api/jobs", "/api/templates", "/api/jobs/1/log", "/static/app.js"):
        assert c.get(path).status_code == 401, path
    assert c.post("/api/jobs", json={"template": "tiny_sd1_lora"}).status_code == 401
    assert c.get("/api/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/jobs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    page = c.get("/?token=s3cret")  # the browser's way in: a cookie for the page's later requests
    assert page.status_code == 200 and "No Job Selected" in page.text
    assert c.get("/api/jobs").status_code == 200  # the cookie
    c.cookies.clear()
    assert c.get("/api/jobs").status_code == 401


def test_off_loopback_needs_a_token(capsys, monkeypatch):
    monkeypatch.delenv("WEBUI_TOKEN", raising=False)
    assert main(["--host", "0.0.0.0", "--port", "1"]) == 2
    assert "--token" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")


def test_jobs_create_list_rename_duplicate_delete(client, jobs_dir):
    names = {t["name"] for t in client.get("/api/templates").json()}
    assert {"tiny_sd1_lora", "tiny_sd1_finetune", "sd_lora", "sd_finetune", "sdxl_lora", "sdxl_finetune", "flux_lora",
            "flux_finetune"} <= names
    assert client.get("/api/jobs").json() == []
    hw = client.get("/api/hardware").json()
    assert isinstance(hw["gpus"], list) and hw["none"] == "No GPU: training runs on CPU"
    assert client.get("/api/info").json()["jobs_dir"] == jobs_dir
    assert client.post("/api/jobs", json={"template": "nope"}).status_code == 422
    job = _create(client, name="<img src=x onerror=alert(1)>")
    assert job["status"] == "draft" and job["name"] == "<img src=x onerror=alert(1)>"  # stored as text
    assert job["command"].endswith(f"python train_network.py --config_file {jobs_dir}/1/config.toml")
    config = toml.load(os.path.join(jobs_dir, "1", "config.toml"))
    assert config["output"]["output_dir"] == os.path.join(jobs_dir, "1", "output")
    assert config["dataset"]["dataset_config"] == os.path.join(jobs_dir, "1", "dataset.toml")
    assert toml.load(os.path.join(jobs_dir, "1", "dataset.toml"))["datasets"][0]["subsets"][0]["num_repeats"] == 1
    assert client.get("/api/jobs/1").json()["name"] == job["name"]
    assert client.get("/api/jobs/99").status_code == 404

    assert client.patch("/api/jobs/1", json={"name": "  my   lora "}).json()["name"] == "my lora"
    assert client.patch("/api/jobs/1", json={"name": ""}).status_code == 422
    copy = client.post("/api/jobs/1/duplicate").json()
    assert copy["id"] == 2 and copy["name"] == "my lora (copy)"
    assert client.get("/api/jobs/2/settings").json() == client.get("/api/jobs/1/settings").json()
    assert [j["id"] for j in client.get("/api/jobs").json()] == [1, 2]

    outside = os.path.join(os.path.dirname(jobs_dir), "keep.txt")
    with open(outside, "w") as f:
        f.write("not the UI's")
    os.symlink(outside, os.path.join(jobs_dir, "2", "link_out"))
    assert client.delete("/api/jobs/2").status_code == 400  # no confirmation
    assert os.path.isdir(os.path.join(jobs_dir, "2"))
    assert client.delete("/api/jobs/2?confirm=yes").json() == {"deleted": 2}
    assert not os.path.exists(os.path.join(jobs_dir, "2")) and os.path.isfile(outside)
    assert [j["id"] for j in client.get("/api/jobs").json()] == [1]
    assert client.delete("/api/jobs/2?confirm=yes").status_code == 404


def test_settings_are_checked_by_the_trainers_own_parser(client, jobs_dir):
    _create(client)
    settings = client.get("/api/jobs/1/settings").json()
    assert "output_dir" not in settings["config"].get("output", {})  # the UI's own keys are not settings
    before = open(os.path.join(jobs_dir, "1", "config.toml")).read()
    settings["config"]["optimizer"]["learning_rate"] = -1
    r = client.put("/api/jobs/1/settings", json=settings)
    assert r.status_code == 422
    assert r.json()["detail"]["field"] == "learning_rate"
    assert r.json()["detail"]["error"].startswith("--learning_rate -1: expected a number in [0, 10]")
    assert open(os.path.join(jobs_dir, "1", "config.toml")).read() == before  # nothing written

    settings["config"]["optimizer"]["learning_rate"] = 5e-4
    settings["config"]["training"]["max_train_steps"] = 7
    settings["prompts"] = ["a red circle --w 64 --h 64 --s 2"]
    r = client.put("/api/jobs/1/settings", json=settings)
    assert r.status_code == 200, r.text
    config = toml.load(os.path.join(jobs_dir, "1", "config.toml"))
    assert config["optimizer"]["learning_rate"] == 5e-4 and config["training"]["max_train_steps"] == 7
    assert config["sampling"]["sample_prompts"] == os.path.join(jobs_dir, "1", "prompts.txt")
    assert r.json()["prompts"] == ["a red circle --w 64 --h 64 --s 2"]
    assert not os.path.exists(os.path.join(jobs_dir, "1", ".check"))

    settings = client.get("/api/jobs/1/settings").json()
    settings["config"]["training"]["max_train_steps"] = 999
    assert client.post("/api/jobs/1/revert").json()["config"]["training"]["max_train_steps"] == 20


def test_error_field_names_the_flag_or_key():
    assert error_field("--network_dim 0: expected an integer >= 1") == "network_dim"
    assert error_field("config.toml: optimizer.learnig_rate: unknown flag (did you mean learning_rate?)") == "learnig_rate"
    assert error_field("dataset.toml: datasets[0].subsets[1].num_repeats: expected an integer >= 1") == "num_repeats"
    assert error_field("something else") is None
    assert one_line_error("INFO x: y\nerror: --network_dim 0: expected an integer >= 1\n") == \
        "--network_dim 0: expected an integer >= 1"
    assert one_line_error("error: c.toml: a.lr: unknown flag\nc.toml: a.dim: unknown flag\n") == \
        "c.toml: a.lr: unknown flag; c.toml: a.dim: unknown flag"
    assert one_line_error("Traceback ...\nValueError: boom\n") == "ValueError: boom"


def test_samples_files_and_traversal(client, jobs_dir, tmp_path):
    _create(client)
    sample_dir = os.path.join(jobs_dir, "1", "output", "sample")
    os.makedirs(sample_dir)
    with open(os.path.join(sample_dir, "lora_000010_00.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
    assert [s["path"] for s in client.get("/api/jobs/1/samples").json()] == ["output/sample/lora_000010_00.png"]
    assert client.get("/api/jobs/1/files/output/sample/lora_000010_00.png").content == b"\x89PNG\r\n\x1a\n"
    assert client.get("/api/jobs/1/files/config.toml").status_code == 200
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    os.symlink(str(secret), os.path.join(jobs_dir, "1", "escape"))
    assert client.get("/api/jobs/1/files/escape").status_code == 403  # a symlink out
    assert client.get("/api/jobs/1/files/%2E%2E/jobs.sqlite3").status_code in (403, 404)
    assert client.get("/api/jobs/1/files/..%2F..%2Fsecret.txt").status_code in (403, 404)
    assert client.get(f"/api/jobs/1/files/{secret}").status_code in (403, 404)  # absolute
    assert client.get("/api/jobs/1/files/nothing.png").status_code == 404
    assert client.get("/api/jobs/9/files/config.toml").status_code == 404

    assert client.get("/api/jobs/1/trained").json() == []
    with open(os.path.join(jobs_dir, "1", "output", "lora.safetensors"), "wb") as f:
        f.write(b"12345678")
    trained = client.get("/api/jobs/1/trained").json()
    assert [(t["path"], t["size"]) for t in trained] == [("output/lora.safetensors", 8)]
    assert client.get("/api/jobs/1/files/output/lora.safetensors").content == b"12345678"

    run_logs = os.path.join(jobs_dir, "1", "output", "logs", "network_train")
    os.makedirs(run_logs)
    for name in ("events.out.tfevents.1.host", "events.out.tfevents.2.host", "notes.txt"):
        open(os.path.join(run_logs, name), "w").close()
    assert client.delete("/api/jobs/1/tensorboard_events").status_code == 400
    assert client.delete("/api/jobs/1/tensorboard_events?confirm=yes").json() == {"deleted": 2}
    assert os.listdir(run_logs) == ["notes.txt"]


def test_tensorboard_launch_and_stop(client, jobs_dir):
    _create(client)
    assert client.get("/api/jobs/1/tensorboard").json() == {"running": False, "status": "Not running", "url": None}
    tb = client.post("/api/jobs/1/tensorboard").json()
    try:
        assert tb["running"] and tb["url"].startswith("http://127.0.0.1:")
        assert client.post("/api/jobs/1/tensorboard").json()["pid"] == tb["pid"]  # one per job
        assert os.path.isdir(os.path.join(jobs_dir, "1", "output", "logs"))
    finally:
        assert client.delete("/api/jobs/1/tensorboard").json()["status"] == "Not running"
    assert not os.path.exists(f"/proc/{tb['pid']}") or open(f"/proc/{tb['pid']}/stat").read().split()[2] == "Z"


def test_folder_picker_and_dataset_paths_stay_inside_the_roots(jobs_dir, tmp_path):
    root = tmp_path / "datasets"
    (root / "10_cats").mkdir(parents=True)
    for name in ("a.png", "b.jpg", "a.txt"):
        (root / "10_cats" / name).write_bytes(b"x")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "p.png").write_bytes(b"x")
    os.symlink(str(tmp_path / "private"), str(root / "link_out"))
    c = TestClient(create_app(jobs_dir, data_roots=[str(root)]))
    assert [f["path"] for f in c.get("/api/folders").json()["folders"]] == [str(root)]
    top = c.get("/api/folders", params={"path": str(root)}).json()
    assert [(f["name"], f["images"]) for f in top["folders"]] == [("10_cats", 2)]  # the link out is not shown
    assert top["parent"] is None
    cats = c.get("/api/folders", params={"path": str(root / "10_cats")}).json()
    assert cats["images"] == 2 and cats["parent"] == str(root) and len(cats["thumbnails"]) == 2
    assert c.get("/api/image", params={"path": cats["thumbnails"][0]}).content == b"x"
    for bad in (str(tmp_path / "private"), str(root / "link_out"), str(root / ".." / "private"), "/etc"):
        assert c.get("/api/folders", params={"path": bad}).status_code == 403, bad
    assert c.get("/api/image", params={"path": str(root / "link_out" / "p.png")}).status_code == 403
    assert c.get("/api/image", params={"path": str(root / "10_cats" / "a.txt")}).status_code == 404
    assert c.get("/api/folders", params={"path": str(root / "nothing")}).status_code == 404

    _create(c)
    settings = c.get("/api/jobs/1/settings").json()
    settings["dataset"]["datasets"][0]["subsets"][0]["image_dir"] = str(root / "link_out")
    r = c.put("/api/jobs/1/settings", json=settings)  # refused before the trainer's check runs
    assert r.status_code == 403 and r.json()["detail"]["field"] == "image_dir"


def test_hardware():
    from webui.hardware import parse_nvidia_smi

    assert parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, 81559, 1, 0\n") == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_used_mib": 1,
         "utilization_percent": 0}]
    assert parse_nvidia_smi("") == []


def test_log_stream_and_progress(client, jobs_dir):
    _create(client)
    body = client.get("/api/jobs/1/log").text  # a draft: nothing to follow
    assert "event: waiting\ndata: Waiting for training to start..." in body and "event: end\ndata: draft" in body
    with open(os.path.join(jobs_dir, "1", "train.log"), "w") as f:
        f.write("INFO x: loading\nsteps:  25%|##5       | 2/8 [00:04<00:12,  2.01s/it, loss=1.1025, lr=1.00e-03]"
                "\rsteps:  50%|#####     | 4/8 [00:08<00:08,  2.00s/it, loss=0.9500, lr=1.00e-03]\r")
    body = client.get("/api/jobs/1/log").text
    assert "data: INFO x: loading\n" in body and "data: steps:  50%" in body and "Waiting" not in body
    resumed = client.get("/api/jobs/1/log", headers={"Last-Event-ID": str(len("INFO x: loading\n"))}).text
    assert "loading" not in resumed and "4/8" in resumed
    p = client.get("/api/jobs/1/status").json()["progress"]
    assert p == {"percent": 50, "step": 4, "total": 8, "elapsed": "00:08", "eta": "00:08", "rate": "2.00s/it",
                 "loss": 0.95, "lr": 1e-3}
    assert logs.progress(os.path.join(jobs_dir, "nothing.log")) is None
    assert client.get("/api/jobs/1/history").json() == [{"step": 2, "loss": 1.1025, "lr": 1e-3},
                                                        {"step": 4, "loss": 0.95, "lr": 1e-3}]
    assert logs.split_lines("steps:   0%|  | 0/8 [00:00<?, ?it/s]INFO trainer: training\rsteps: 1/8\n") == [
        "steps:   0%|  | 0/8 [00:00<?, ?it/s]", "INFO trainer: training", "steps: 1/8"]


def test_auto_resume_after_a_crash_is_bounded(client, jobs_dir, monkeypatch, tmp_path):
    """A crashed run of a job with resume = "auto" is started again, at most twice in a row; the trainer's
    refusal of the settings (exit code 2) and a stop are not retried. (A stand-in command: no training.)"""
    import sys

    import webui.runner

    script = tmp_path / "crash.py"
    script.write_text("import os, sys\n"
                      "n = int(open(sys.argv[1]).read()) if os.path.exists(sys.argv[1]) else 0\n"
                      "open(sys.argv[1], 'w').write(str(n + 1))\n"
                      "print('run', n + 1)\n"
                      "sys.exit(int(sys.argv[2].split(',')[n]))\n")
    codes = {}
    monkeypatch.setattr(webui.runner, "training_command",
                        lambda job, folder: [sys.executable, str(script), str(tmp_path / f"count{job['id']}"),
                                             codes[job["id"]]])
    runner = client.app.state.runner
    for job_id, exit_codes, status, runs in ((1, "1,137,0", "finished", 3), (2, "1,1,1,1", "failed", 3),
                                             (3, "2,0", "failed", 1)):
        _create(client)
        codes[job_id] = exit_codes
        client.post(f"/api/jobs/{job_id}/start")
        assert runner.wait(job_id, 30) == status
        assert len(client.get(f"/api/jobs/{job_id}/status").json()["runs"]) == runs
    log = client.get("/api/jobs/2/log").text
    assert "auto-resume: retry 2 of 2" in log and "retry 3" not in log


def _wait_for_step(client, job_id, step, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = client.get(f"/api/jobs/{job_id}/status").json()
        if s["status"] != "running" or (s["progress"] and s["progress"]["step"] >= step):
            return s
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s:\n" + open(os.path.join(
        client.app.state.runner.jobs_dir, str(job_id), "train.log")).read()[-3000:])


def test_tiny_job_trains_stops_resumes_and_survives_a_server_restart(client, jobs_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the run inherits it: fast and steady on a shared 2-core machine
    _create(client, name="tiny")
    folder = os.path.join(jobs_dir, "1")
    config = toml.load(os.path.join(folder, "config.toml"))
    config["training"].update(max_train_steps=4, save_every_n_steps=100)
    with open(os.path.join(folder, "config.toml"), "w") as f:  # as a hand edit: the checked PUT is tested above
        toml.dump(config, f)
    _create(client, name="second")

    r = client.post("/api/jobs/1/start").json()
    assert r["status"] == "running" and r["job"]["pid"]
    assert client.post("/api/jobs/1/start").json()["status"] == "running"  # already running: nothing new
    assert client.post("/api/jobs/2/start").json()["status"] == "queued"  # one run at a time
    assert client.post("/api/jobs/2/stop").json()["status"] == "stopped"  # leaves the queue, never ran
    assert client.put("/api/jobs/1/settings", json={}).status_code == 409
    assert client.delete("/api/jobs/1?confirm=yes").status_code == 409

    s = _wait_for_step(client, 1, 1, 120)
    assert s["status"] == "running", open(os.path.join(folder, "train.log")).read()[-3000:]
    assert client.post("/api/jobs/1/stop").json()["status"] == "stopping"
    assert client.app.state.runner.wait(1, 60) == "stopped"
    s = client.get("/api/jobs/1/status").json()
    assert s["exit_code"] == 130 and s["runs"][0]["status"] == "stopped"
    assert s["progress"]["step"] < 4
    states = [n for n in os.listdir(os.path.join(folder, "output")) if n.endswith("-state")]
    assert states, os.listdir(os.path.join(folder, "output"))  # Ctrl+C saved a state

    assert client.post("/api/jobs/1/start").json()["status"] == "running"  # resume = "auto" in the template
    restarted = TestClient(create_app(jobs_dir))  # a new server: re-attaches to the run by pid + start time
    assert restarted.get("/api/jobs/1/status").json()["status"] == "running"
    assert restarted.app.state.runner.wait(1, 150) == "finished", open(os.path.join(folder, "train.log")).read()[-3000:]
    s = restarted.get("/api/jobs/1/status").json()
    assert s["exit_code"] == 0 and [r["status"] for r in s["runs"]] == ["stopped", "finished"]
    assert s["progress"]["step"] == 4 and s["progress"]["total"] == 4
    log = restarted.get("/api/jobs/1/log").text
    assert "--resume auto: newest intact state is" in log and f"saved {folder}/output/lora.safetensors" in log
    assert log.count("$ cd ") == 2  # the command of each run
    assert os.path.isfile(os.path.join(folder, "output", "lora.safetensors"))


# --- issue 14, second part: dataset TOML check, Performance, GPUs and strategy, settings history ----------------

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_used_mib": 1, "utilization_percent": 0}
TWO_GPUS = [{"index": 0, **H100}, {"index": 1, **H100}]


def test_dataset_folders_checked_on_save_and_kept_in_the_history(client, jobs_dir):
    """The dataset TOML goes through the trainer's own --check_config (its dataset-config validation): the error
    names the folder (subset) and key; a good save is a revision saying what changed; a revision comes back."""
    _create(client)
    dataset_toml = os.path.join(jobs_dir, "1", "dataset.toml")
    before = open(dataset_toml).read()
    settings = client.get("/api/jobs/1/settings").json()
    assert settings["launch"] == {}
    subsets = settings["dataset"]["datasets"][0]["subsets"]
    subsets.append({"image_dir": "examples/data/train/10_sks shape", "num_repeats": 0, "is_reg": True})
    r = client.put("/api/jobs/1/settings", json=settings)
    assert r.status_code == 422
    assert r.json()["detail"] == {"error": "dataset.toml: datasets[0].subsets[1].num_repeats: expected an integer "
                                           ">= 1, got 0", "field": "num_repeats", "where": "datasets[0].subsets[1]"}
    assert open(dataset_toml).read() == before

    subsets[1].update(image_dir="examples/no such folder", num_repeats=3)  # refused before the trainer's check
    r = client.put("/api/jobs/1/settings", json=settings)
    assert r.status_code == 422 and r.json()["detail"] == {
        "error": "dataset.toml: datasets[0].subsets[1].image_dir: no such folder: examples/no such folder",
        "field": "image_dir", "where": "datasets[0].subsets[1]"}

    subsets[1]["image_dir"] = "examples/data/train/10_sks shape"
    settings["config"]["optimizer"]["learning_rate"] = 2e-3
    settings["config"]["diagnostics"] = {"profile_steps": True}  # a Diagnostics flag, through --check_config
    settings["config"]["training"]["torch_compile"] = True  # a Performance option this machine can use
    r = client.put("/api/jobs/1/settings", json=settings)
    assert r.status_code == 200, r.text
    written = toml.load(dataset_toml)["datasets"][0]["subsets"]
    assert [(s["num_repeats"], s.get("is_reg", False)) for s in written] == [(1, False), (3, True)]
    assert toml.load(os.path.join(jobs_dir, "1", "config.toml"))["diagnostics"] == {"profile_steps": True}

    history = client.get("/api/jobs/1/revisions").json()
    assert [h["id"] for h in history] == [2, 1]
    assert history[1]["changes"] == "created from the template tiny_sd1_lora"
    assert history[0]["changes"] == ("profile_steps: set to true; learning_rate: 0.001 -> 0.002; torch_compile: set to "
                                      "true; subsets[1].image_dir: set to examples/data/train/10_sks shape; "
                                      "subsets[1].is_reg: set to true; subsets[1].num_repeats: set to 3")
    assert client.get("/api/jobs/1/revisions/1").json()["settings"]["config"]["optimizer"]["learning_rate"] == 1e-3
    assert client.get("/api/jobs/1/revisions/9").status_code == 404
    assert client.post("/api/jobs/1/revisions/9/restore").status_code == 404
    assert client.get("/api/jobs/7/revisions").status_code == 404

    client.app.state.store.update_job(1, status="queued")
    assert client.post("/api/jobs/1/revisions/1/restore").status_code == 409
    client.app.state.store.update_job(1, status="draft")
    restored = client.post("/api/jobs/1/revisions/1/restore")
    assert restored.status_code == 200, restored.text
    assert restored.json()["config"]["optimizer"]["learning_rate"] == 1e-3
    assert len(toml.load(dataset_toml)["datasets"][0]["subsets"]) == 1
    latest = client.get("/api/jobs/1/revisions").json()[0]
    assert latest["id"] == 3 and latest["changes"].startswith(
        "restored revision 1: profile_steps: removed (was true); learning_rate: 0.002 -> 0.001; ")
    assert client.post("/api/jobs/1/revert").status_code == 200
    assert client.get("/api/jobs/1/revisions").json()[0]["changes"] == "reverted to the template: no changes"


def test_history_changes_line():
    from webui.history import changes

    old = {"config": {"training": {"max_train_steps": 20}}, "dataset": {"datasets": [{"resolution": 64}]},
           "prompts": []}
    new = {"config": {"training": {"max_train_steps": 40, "seed": 1}}, "dataset": {"datasets": [{}]},
           "prompts": ["a cat"], "launch": {"strategy": "ddp"}}
    assert changes(None, new) == "first save"
    assert changes(old, old) == "no changes"
    assert changes(old, new) == ('max_train_steps: 20 -> 40; seed: set to 1; resolution: removed (was 64); '
                                 'strategy: set to ddp; prompts: [] -> ["a cat"]')


def test_performance_options_say_why_not():
    from webui.performance import availability, refusal

    flags = frozenset({"persistent_data_loader_workers", "gradient_checkpointing", "highvram", "lowram",
                       "blocks_to_swap", "cpu_offload_checkpointing"})
    none = availability("sd", "train_network.py", 0, installed=lambda m: m == "torch", flags=flags)
    assert {o["key"]: o["reason"] for o in none} == {
        "persistent_data_loader_workers": None, "gradient_checkpointing": None,
        "flash_attn": "no GPU on this machine; requires flash-attn (pip install flash-attn): not installed; "
                      "the trainer (train_network.py) has no --flash_attn flag yet",
        "torch_compile": "the trainer (train_network.py) has no --torch_compile flag yet",
        "dynamo_backend": "the trainer (train_network.py) has no --dynamo_backend flag yet",
        "dynamo_mode": "the trainer (train_network.py) has no --dynamo_mode flag yet",
        "memory": "no GPU on this machine",
        "blocks_to_swap": "not supported for sd (DiT families only: flux, sd3, anima, chroma, lumina, hunyuan_image); "
                          "no GPU on this machine",
        "cpu_offload_checkpointing": "no GPU on this machine",
        "profile_steps": "the trainer (train_network.py) has no --profile_steps flag yet",
        "profile_microbatches": "the trainer (train_network.py) has no --profile_microbatches flag yet"}
    flux = availability("flux", "flux_train_network.py", 2, installed=lambda m: True,
                        flags=flags | {"flash_attn", "torch_compile", "dynamo_backend", "dynamo_mode", "profile_steps",
                                       "profile_microbatches"})
    assert all(o["available"] for o in flux)
    assert refusal({"memory": {"blocks_to_swap": 8}}, flux) is None
    assert refusal({"memory": {"cpu_offload_checkpointing": True}}, flux) == (
        "--cpu_offload_checkpointing: requires gradient checkpointing (turn it on first)", "cpu_offload_checkpointing")
    assert refusal({"memory": {"cpu_offload_checkpointing": True}, "training": {"gradient_checkpointing": True}},
                   flux) is None
    assert refusal({"training": {"highvram": True, "lowram": True}}, flux)[1] == "memory"
    assert refusal({"training": {"dynamo_backend": "aot_eager"}}, flux) == (
        "--dynamo_backend: only with torch compile on", "dynamo_backend")
    assert refusal({"training": {"dynamo_backend": "aot_eager", "torch_compile": True}}, flux) is None
    assert refusal({"memory": {"blocks_to_swap": 8}}, none) == (
        ("--blocks_to_swap: not available: not supported for sd (DiT families only: flux, sd3, anima, chroma, lumina, "
         "hunyuan_image); no GPU on this machine"), "blocks_to_swap")
    for family, swaps in (("sd3", True), ("anima", True), ("chroma", True), ("lumina", True),
                          ("hunyuan_image", True), ("sdxl", False)):  # as the trainer's
        options = availability(family, "x.py", 1, installed=lambda m: True, flags=flags)  # family_supports_block_swap
        assert [o["available"] for o in options if o["key"] in ("blocks_to_swap", "cpu_offload_checkpointing")] == \
            [swaps, True], family  # activation offload: every family


def test_performance_endpoint_and_refused_saves(jobs_dir):
    c = TestClient(create_app(jobs_dir, find_gpus=list))
    assert c.get("/api/jobs/1/performance").status_code == 404
    _create(c)
    options = {o["key"]: o for o in c.get("/api/jobs/1/performance").json()}
    assert list(options) == ["persistent_data_loader_workers", "gradient_checkpointing", "flash_attn", "torch_compile",
                             "dynamo_backend", "dynamo_mode", "memory", "blocks_to_swap", "cpu_offload_checkpointing",
                             "profile_steps", "profile_microbatches"]
    assert [o["group"] for o in options.values()] == ["performance"] * 9 + ["diagnostics"] * 2
    assert options["torch_compile"]["available"] and options["dynamo_backend"]["needs"] == "torch_compile"
    assert options["gradient_checkpointing"]["available"] and options["persistent_data_loader_workers"]["available"]
    assert options["persistent_data_loader_workers"]["needs_reason"] == "needs data-loader workers > 0"
    assert options["flash_attn"]["reason"].startswith("no GPU on this machine; requires flash-attn")
    assert options["blocks_to_swap"]["reason"].startswith("not supported for sd (DiT families only")
    assert options["profile_steps"]["available"] and options["profile_microbatches"]["available"]  # the trainer has them
    config_toml = os.path.join(jobs_dir, "1", "config.toml")
    before = open(config_toml).read()
    settings = c.get("/api/jobs/1/settings").json()
    for section, key, value, field, error in (
            ("training", "flash_attn", True, "flash_attn", "--flash_attn: not available: no GPU on this machine; "),
            ("memory", "blocks_to_swap", 4, "blocks_to_swap", "--blocks_to_swap: not available: not supported for sd"),
            ("training", "highvram", True, "memory", "--highvram/--lowram: not available: no GPU on this machine"),
            ("dataset", "persistent_data_loader_workers", True, "persistent_data_loader_workers",
             "--persistent_data_loader_workers: needs data-loader workers > 0")):  # the template has 0 workers
        changed = {**settings, "config": {**settings["config"], section: {**settings["config"].get(section, {}),
                                                                          key: value}}}
        r = c.put("/api/jobs/1/settings", json=changed)
        assert r.status_code == 422 and r.json()["detail"]["field"] == field, r.text
        assert r.json()["detail"]["error"].startswith(error) and "\n" not in r.json()["detail"]["error"]
    assert open(config_toml).read() == before
    r = c.put("/api/jobs/1/settings", json={**settings, "launch": {"strategy": "ddp"}})
    assert r.status_code == 422 and r.json()["detail"]["error"] == (
        "strategy: ddp needs GPUs (none on this machine): on the CPU, accelerate launch runs one process; choose "
        "single")


def test_gpu_choice_and_strategy_write_the_accelerate_config(jobs_dir):
    """GPUs (a stand-in for nvidia-smi: two H100s) and the strategy are the job's launch.toml; the accelerate
    config is written by tools/make_accelerate_config.py (its one-line refusals come back next to the option)
    and the run becomes `CUDA_VISIBLE_DEVICES=0,1 accelerate launch --config_file <job>/accelerate_config.yaml`."""
    import yaml

    from webui.jobfiles import REPO_ROOT, JobFolder
    from webui.runner import gpu_environment

    c = TestClient(create_app(jobs_dir, find_gpus=lambda: TWO_GPUS))
    assert c.get("/api/hardware").json()["gpus"] == TWO_GPUS
    _create(c)
    folder = os.path.join(jobs_dir, "1")
    settings = c.get("/api/jobs/1/settings").json()
    for launch, field, error in (
            ({"gpu_ids": [3]}, "gpu_ids", "gpu_ids: no GPU 3 on this machine (GPUs found: 0, 1)"),
            ({"gpu_ids": [0, 1]}, "strategy", ("strategy: 2 GPUs selected: choose a multi-GPU strategy (DDP, FSDP1, "
                                              "FSDP2 or DeepSpeed)")),
            ({"gpu_ids": [0], "strategy": "ddp"}, "gpu_ids", ("gpu_ids: ddp runs one process per chosen GPU: choose 2 "
                                                             "or more")),
            ({"gpu_ids": [0, 1], "strategy": "fsdp1", "fsdp_use_orig_params": False}, "fsdp_use_orig_params",
             ("fsdp_use_orig_params: must stay on with LoRA (frozen base weights and trained LoRA weights share FSDP "
             "units)")),
            ({"gpu_ids": [0, 1], "strategy": "fsdp2", "fsdp_limit_all_gathers": False}, "fsdp_limit_all_gathers",
             "tools/make_accelerate_config.py: --fsdp_limit_all_gathers false: accelerate's config has no key for it"),
            ({"strategy": "nccl"}, "strategy", ("strategy: expected one of single, ddp, fsdp1, fsdp2, deepspeed, got "
                                               "'nccl'"))):
        r = c.put("/api/jobs/1/settings", json={**settings, "launch": launch})
        assert r.status_code == 422 and r.json()["detail"]["field"] == field, r.text
        assert r.json()["detail"]["error"].startswith(error), r.text
    assert not os.path.exists(os.path.join(folder, "accelerate_config.yaml"))
    assert not os.path.exists(os.path.join(folder, ".accelerate_config.yaml"))

    launch = {"gpu_ids": [1, 0], "strategy": "fsdp1", "fsdp_wrap_policy": "SIZE_BASED_WRAP",
              "fsdp_min_num_params": 1000, "fsdp_forward_prefetch": True, "fsdp_reshard_after_forward": False,
              "zero_stage": 3}  # a DeepSpeed option: not this strategy's, dropped
    settings["config"]["training"]["mixed_precision"] = "bf16"
    r = c.put("/api/jobs/1/settings", json={**settings, "launch": launch})
    assert r.status_code == 200, r.text
    assert r.json()["launch"] == {"gpu_ids": [0, 1], "strategy": "fsdp1", "fsdp_wrap_policy": "SIZE_BASED_WRAP",
                                  "fsdp_min_num_params": 1000, "fsdp_forward_prefetch": True,
                                  "fsdp_reshard_after_forward": False}
    written = yaml.safe_load(open(os.path.join(folder, "accelerate_config.yaml")))
    assert (written["distributed_type"], written["num_processes"], str(written["gpu_ids"]),
            written["mixed_precision"]) == ("FSDP", 2, "0,1", "bf16")
    fsdp = written["fsdp_config"]
    assert (fsdp["fsdp_version"], fsdp["fsdp_auto_wrap_policy"], fsdp["fsdp_min_num_params"],
            fsdp["fsdp_forward_prefetch"], fsdp["fsdp_sharding_strategy"]) == (1, "SIZE_BASED_WRAP", 1000, True,
                                                                               "SHARD_GRAD_OP")
    assert gpu_environment(JobFolder(jobs_dir, 1)) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert c.get("/api/jobs/1").json()["command"] == (
        f"cd {REPO_ROOT} && CUDA_VISIBLE_DEVICES=0,1 accelerate launch --config_file {folder}/accelerate_config.yaml "
        f"train_network.py --config_file {folder}/config.toml")
    assert "launch" not in toml.load(os.path.join(folder, "config.toml"))  # the UI's own file, not a trainer flag

    r = c.post("/api/jobs/1/revert")  # the template has no strategy: one process, no accelerate config
    assert r.status_code == 200 and r.json()["launch"] == {}
    assert not os.path.exists(os.path.join(folder, "accelerate_config.yaml"))
    assert c.get("/api/jobs/1").json()["command"].endswith(f"python train_network.py --config_file {folder}/config.toml")


def test_the_run_sees_only_the_chosen_gpus(client, jobs_dir, monkeypatch, tmp_path):
    """The runner gives the run CUDA_VISIBLE_DEVICES from launch.toml's gpu_ids and logs it with the command.
    (A stand-in command that prints what it sees: no training.)"""
    import sys

    import webui.runner

    script = tmp_path / "show.py"
    script.write_text("import os\nprint('visible:', os.environ.get('CUDA_VISIBLE_DEVICES'))\n")
    monkeypatch.setattr(webui.runner, "training_command", lambda job, folder: [sys.executable, str(script)])
    _create(client)
    with open(os.path.join(jobs_dir, "1", "launch.toml"), "w") as f:  # as a hand edit: the checked PUT is above
        f.write("gpu_ids = [0, 2]\n")
    client.post("/api/jobs/1/start")
    assert client.app.state.runner.wait(1, 30) == "finished"
    log = client.get("/api/jobs/1/log").text
    assert "data: $ cd " in log and " && CUDA_VISIBLE_DEVICES=0,2 python " in log and "data: visible: 0,2\n" in log


# --- SD3 / SD3.5, Anima and Chroma: templates, scripts, the trainer's check ----------------------------------------

NEW_FAMILY_SCRIPTS = {("sd3", "lora"): "sd3_train_network.py", ("sd3", "finetune"): "sd3_train.py",
                      ("anima", "lora"): "anima_train_network.py", ("anima", "finetune"): "anima_train.py",
                      ("chroma", "lora"): "flux_train_network.py", ("chroma", "finetune"): "flux_train.py",
                      ("lumina", "lora"): "lumina_train_network.py", ("lumina", "finetune"): "lumina_train.py"}


def test_sd3_anima_chroma_templates_pass_the_trainers_check(jobs_dir, monkeypatch):
    """A job of each new family and mode, created from its template: the page's command runs the family's script;
    with the built-in tiny model (the template's /models/... paths do not exist here), AdamW (no bitsandbytes)
    and the example images, saving passes that script's own --check_config (the six checks run side by side).
    Anima: "keep the LLM adapter frozen" is llm_adapter_lr = 0, accepted by anima_train.py. A Chroma job must keep
    model_type = "chroma" (else the FLUX.1 script would train FLUX.1): refused at once, one line."""
    from concurrent.futures import ThreadPoolExecutor

    from webui import performance
    from webui.jobfiles import REPO_ROOT

    # the scripts' --help (the Performance options' flags) is not what this test is about: the option flags as given
    flags = frozenset(o[0] for o in performance.OPTIONS) | set(performance.MEMORY_FLAGS)
    monkeypatch.setattr(performance, "trainer_flags", lambda script, timeout=120: flags)
    c = TestClient(create_app(jobs_dir, find_gpus=list))
    templates = {t["name"]: t for t in c.get("/api/templates").json()}
    jobs = {}
    for (family, mode), script in NEW_FAMILY_SCRIPTS.items():
        t = templates[f"{family}_{mode}"]
        assert (t["family"], t["mode"]) == (family, mode)
        job = _create(c, template=f"{family}_{mode}")
        folder = os.path.join(jobs_dir, str(job["id"]))
        assert (job["family"], job["script"]) == (family, script)
        assert job["command"] == f"cd {REPO_ROOT} && python {script} --config_file {folder}/config.toml"
        settings = c.get(f"/api/jobs/{job['id']}/settings").json()
        model = settings["config"]["model"]
        assert model["pretrained_model_name_or_path"].startswith("/models/")  # placeholders, as the FLUX.1 ones
        model["pretrained_model_name_or_path"] = f"tiny:{family}"
        settings["config"]["optimizer"]["optimizer_type"] = "AdamW"
        settings["dataset"]["datasets"][0]["subsets"][0]["image_dir"] = "examples/data/train/10_sks shape"
        if (family, mode) == ("anima", "finetune"):
            settings["config"]["optimizer"]["llm_adapter_lr"] = 0
        jobs[(family, mode)] = (job["id"], settings)
    assert {k: set(s["config"]["model"]) for k, (_, s) in jobs.items() if k[1] == "lora"} == {
        ("sd3", "lora"): {"pretrained_model_name_or_path", "clip_l", "clip_g", "t5xxl"},
        ("anima", "lora"): {"pretrained_model_name_or_path", "qwen3", "vae"},
        ("chroma", "lora"): {"model_type", "pretrained_model_name_or_path", "t5xxl", "ae", "apply_t5_attn_mask",
                             "guidance_scale"},  # no clip_l for Chroma
        ("lumina", "lora"): {"pretrained_model_name_or_path", "gemma2", "ae"}}
    assert {k[0]: s["config"].get("network", {}).get("network_module") for k, (_, s) in jobs.items()
            if k[1] == "lora"} == {"sd3": "networks.lora_sd3", "anima": "networks.lora_anima",
                                   "chroma": "networks.lora_flux", "lumina": "networks.lora_lumina"}

    chroma_id, chroma = jobs[("chroma", "lora")]
    for model_type, got in ((None, "blank"), ("flux", '"flux"')):
        model = {k: v for k, v in chroma["config"]["model"].items() if k != "model_type"}
        if model_type:
            model["model_type"] = model_type
        r = c.put(f"/api/jobs/{chroma_id}/settings", json={**chroma, "config": {**chroma["config"], "model": model}})
        assert r.status_code == 422 and r.json()["detail"] == {
            "error": f'model_type: a chroma job needs model_type "chroma" (the FLUX.1 scripts train the model it '
                     f'names), got {got}', "field": "model_type"}

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(jobs, pool.map(lambda js: c.put(f"/api/jobs/{js[0]}/settings", json=js[1]),
                                          jobs.values())))
    for key, r in results.items():
        assert r.status_code == 200, (key, r.text)
    written = {k: toml.load(os.path.join(jobs_dir, str(i), "config.toml")) for k, (i, _) in jobs.items()}
    assert written[("anima", "finetune")]["optimizer"]["llm_adapter_lr"] == 0
    assert written[("chroma", "finetune")]["model"]["model_type"] == "chroma"
    assert all(w["model"]["pretrained_model_name_or_path"].startswith("tiny:") for w in written.values())
