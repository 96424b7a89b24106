"""The web UI templates of FLUX.2 [dev] (webui/templates/flux2_dev_lora.toml) and Qwen-Image-Edit-2509
(qwen_image_edit_lora.toml, control images): jobs made from them through the UI's API run the family's script, their
settings (model files on the tiny presets, AdamW for AdamW8bit, an edit dataset with control images for the edit one)
pass the Save (the trainer's own --check_config, the dataset folders), and the job the UI wrote trains real steps
through the UI's runner."""

from __future__ import annotations

import os

import pytest
import toml

pytest.importorskip("fastapi", reason="the web UI needs fastapi: pip install -r requirements-dev.txt")
from fastapi.testclient import TestClient  # noqa: E402

from tests.test_edit_training import make_edit_dataset  # noqa: E402
from tests.train_helpers import web_ui_template  # noqa: E402
from webui.app import create_app  # noqa: E402
from webui.jobfiles import REPO_ROOT, templates  # noqa: E402

# template name: (family, script, tiny preset, {model keys and values the test checks}, text-length key and value)
CASES = {
    "flux2_dev_lora": ("flux2", "flux2_train_network.py", "tiny:flux2_dev",
                       {"model_version": "dev", "guidance_scale": 1.0}, ("mistral3_max_token_length", 32)),
    "qwen_image_edit_lora": ("qwen_image", "qwen_image_train_network.py", "tiny:qwen_image_edit",
                             {"model_version": "edit-2509"}, None),
}


def test_templates_name_the_dev_and_edit_settings():
    """The two templates against the klein / Qwen-Image ones of the same family (web_ui_template checks those run
    the family's LoRA script): the same network module, timesteps and optimizer; dev and edit-2509 named, the DiT
    only (network_train_unet_only: the text encoders stay frozen and cached); the edit one's subset has a
    control_directory, as FLUX.1 Kontext's template has."""
    all_templates = templates()
    for name, (family, _, _, model, _) in CASES.items():
        t, base = all_templates[name], web_ui_template(family, "lora")
        assert (t["template"]["family"], t["template"]["mode"]) == (family, "lora")
        config = t["config"]
        assert {k: config["model"][k] for k in model} == model
        assert config["network"]["network_module"] == base["config"]["network"]["network_module"]
        assert config["network"]["network_train_unet_only"] is True
        for key in ("timestep_sampling", "weighting_scheme", "discrete_flow_shift"):
            assert config["training"].get(key) == base["config"]["training"].get(key), (name, key)
        assert config["optimizer"] == base["config"]["optimizer"]
        assert config["caching"] == {"cache_latents": True, "cache_text_encoder_outputs": True}
    assert set(all_templates["qwen_image_edit_lora"]["dataset"]["datasets"][0]["subsets"][0]) == \
        set(all_templates["flux_kontext_lora"]["dataset"]["datasets"][0]["subsets"][0]) == \
        {"image_dir", "control_directory", "num_repeats"}
    assert "control_directory" not in all_templates["flux2_dev_lora"]["dataset"]["datasets"][0]["subsets"][0]


@pytest.mark.parametrize("name", list(CASES))
def test_template_job_saves_and_trains_on_the_tiny_preset(tmp_path, monkeypatch, name):
    """A job made from the template through the API: its command runs the family's script; with the tiny preset for
    the /models/... files, AdamW, 1 step at 64 px on CPU and (edit) a folder of targets with their control images,
    the Save passes the trainer's own --check_config and the folder checks; Start trains it through the UI's runner
    to a LoRA file. The template's model_version and guidance are what the run gets (the loader checks
    model_version against the files)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    family, script, preset, model, text_length = CASES[name]
    jobs_dir = str(tmp_path / "jobs")
    data = tmp_path / "data"
    make_edit_dataset(str(data))  # target/ (64x64 + captions) and control/ (one control image per target)
    c = TestClient(create_app(jobs_dir, find_gpus=list, data_roots=[REPO_ROOT, "/models", str(tmp_path)],
                              stop_timeout=30))
    r = c.post("/api/jobs", json={"template": name, "name": name})
    assert r.status_code == 201, r.text
    job = r.json()
    folder = os.path.join(jobs_dir, str(job["id"]))
    assert (job["family"], job["script"]) == (family, script)
    assert job["command"] == f"cd {REPO_ROOT} && python {script} --config_file {folder}/config.toml"

    settings = c.get(f"/api/jobs/{job['id']}/settings").json()
    config = settings["config"]
    assert config["model"]["pretrained_model_name_or_path"].startswith("/models/")
    # the other model files are blank: the tiny preset holds them all (Save checks that the files exist)
    config["model"] = {k: "" if isinstance(v, str) and v.startswith("/") else v for k, v in config["model"].items()}
    config["model"]["pretrained_model_name_or_path"] = preset
    if text_length:
        config["model"][text_length[0]] = text_length[1]
    config["optimizer"]["optimizer_type"] = "AdamW"
    config["training"].update(max_train_steps=1, max_train_epochs=None, save_every_n_epochs=None,
                              mixed_precision="no", max_data_loader_n_workers=0)  # epochs would override the steps
    config["training"] = {k: v for k, v in config["training"].items() if v is not None}
    config["output"].pop("log_with")
    dataset = settings["dataset"]
    dataset["datasets"][0].update(resolution=64, min_bucket_reso=64, max_bucket_reso=128)
    subset = dataset["datasets"][0]["subsets"][0]
    subset["image_dir"] = str(data / "target")
    if "control_directory" in subset:
        subset["control_directory"] = str(data / "control")
    r = c.put(f"/api/jobs/{job['id']}/settings", json=settings)
    assert r.status_code == 200, r.text
    written = toml.load(os.path.join(folder, "config.toml"))
    assert {k: written["model"][k] for k in model} == model

    assert c.post(f"/api/jobs/{job['id']}/start").json()["status"] == "running"
    status = c.app.state.runner.wait(job["id"], 400)
    log = c.get(f"/api/jobs/{job['id']}/log").text
    assert status == "finished", log[-3000:]
    assert c.get(f"/api/jobs/{job['id']}/status").json()["exit_code"] == 0
    lora = os.path.join(folder, "output", f"{config['output']['output_name']}.safetensors")
    assert os.path.isfile(lora), log[-3000:]
    assert "run ended at step 1 of 1 " in log
