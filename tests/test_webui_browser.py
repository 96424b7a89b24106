"""The web UI in headless Chromium (Debian's chromium + chromium-driver, driven by selenium; no browser
download): create a job from a template, change a setting, see the trainer's validation error next to the
field, start the job, see the console stream, the progress, the loss chart and a sample image, stop it, delete
the TensorBoard event files; on the way, Performance reasons, a second dataset folder, a strategy and a restored
settings revision. With UPDATE_SCREENSHOTS=1 it saves docs/images/webui_{job,samples,settings,multigpu}.png.

`bash scripts/test.sh` installs chromium and chromium-driver with apt when they are missing and it runs as root;
otherwise this test is skipped and says what to install."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import toml

pytest.importorskip("fastapi", reason="the web UI needs fastapi: pip install -r requirements-dev.txt")
uvicorn = pytest.importorskip("uvicorn", reason="pip install -r requirements-dev.txt")
pytest.importorskip("selenium", reason="pip install -r requirements-dev.txt")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from webui.app import create_app  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs Debian's chromium and chromium-driver: apt-get install -y chromium "
                                       "chromium-driver (bash scripts/test.sh does it when run as root)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the training run inherits it (shared 2-core machines)
    from webui.jobfiles import REPO_ROOT

    # as on a machine without GPUs; the templates' /models/... placeholders are in an allowed folder
    app = create_app(str(tmp_path / "jobs"), stop_timeout=30, find_gpus=list,
                     data_roots=[REPO_ROOT, os.getcwd(), "/models"])
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", app
    for job in app.state.store.jobs():  # never leave a run behind
        if job["status"] == "running":
            app.state.runner.stop(job["id"])
            app.state.runner.wait(job["id"], 60)
    srv.should_exit = True
    thread.join(10)


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


from tests.test_finetune_tools import tiny_wd14  # noqa: E402,F401  (the fixture: a tiny ONNX WD14 tagger)


def tab(browser, name):
    """Open one of the page's tabs (Model, Data, Training, Performance, Multi-GPU, Sampling, Run, Outputs)."""
    browser.find_element(By.CSS_SELECTOR, f'#tabs a[data-tab="{name}"]').click()


def test_create_change_validate_start_watch_stop(server, browser, tmp_path):
    url, app = server
    # UPDATE_SCREENSHOTS=1 writes them to docs/images/ (docs/webui.md shows them); otherwise to a temporary folder
    shots = os.path.join(ROOT, "docs", "images") if os.environ.get("UPDATE_SCREENSHOTS") == "1" else str(tmp_path)
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)
    browser.get(url + "/")
    assert "No Job Selected" in browser.find_element(By.ID, "empty-state").text
    assert "Create a new training job or select one from the sidebar" in browser.page_source
    assert "No jobs yet." in browser.find_element(By.ID, "sidebar").text

    # create from a template; the name is shown as text, never as markup
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#template-select option"))
    Select(browser.find_element(By.ID, "template-select")).select_by_value("tiny_sd1_lora")
    browser.find_element(By.ID, "new-name").send_keys("<b>shapes</b> LoRA")
    browser.find_element(By.ID, "create-btn").click()
    wait.until(lambda d: d.find_element(By.ID, "job-name").text == "<b>shapes</b> LoRA")
    # the sidebar is redrawn by its poll: read the item in one go, again when it was replaced meanwhile
    listed = WebDriverWait(browser, 60, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    item_text, bold = listed.until(lambda d: (lambda li: (li.text, li.find_elements(By.TAG_NAME, "b")))(
        d.find_element(By.CSS_SELECTOR, "#job-list li")))
    assert "<b>shapes</b> LoRA" in item_text and not bold
    assert "draft" in item_text
    assert "python train_network.py --config_file" in browser.find_element(By.ID, "command").get_attribute("textContent")
    gpus = wait.until(lambda d: d.find_elements(By.ID, "gpus"))  # the form, once the server said what it can use
    assert gpus[0].get_attribute("textContent") == "No GPU: training runs on CPU"  # in the Multi-GPU tab

    # the dataset folder: image count and thumbnails; the server-side picker lists folders with their counts
    assert browser.find_element(By.CSS_SELECTOR, "#tabs a.active").text == "Model"  # a draft opens on its settings
    tab(browser, "Data")
    first = '#folder-rows .folder-row[data-index="0"] '
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, first + ".folder-info").text == "7 image(s)")
    assert len(browser.find_elements(By.CSS_SELECTOR, first + ".thumbs img")) == 7
    browser.find_element(By.CSS_SELECTOR, first + ".browse-btn").click()
    wait.until(lambda d: "Use this folder (7 images)" in d.find_element(By.CSS_SELECTOR, first + ".picker").text)

    # the fields are drawn from the trainer's --describe_flags: its help, range, default and choices
    tab(browser, "Model")
    dim = browser.find_element(By.CSS_SELECTOR, '.field[data-field="network_dim"]')
    assert dim.find_element(By.CSS_SELECTOR, ".help").text == "LoRA rank (default 4, as sd-scripts); an integer >= 1"
    assert dim.find_element(By.TAG_NAME, "input").get_attribute("placeholder") == "default: 4"
    precision = Select(browser.find_element(By.ID, "f-mixed_precision"))
    assert [o.get_attribute("value") for o in precision.options] == ["", "no", "fp16", "bf16"]
    browser.save_screenshot(os.path.join(os.environ.get("WEBUI_SHOTS", "/tmp"), "webui_described_form.png"))

    # a bad value: the trainer's own one-line error, next to the field
    tab(browser, "Training")
    lr = browser.find_element(By.ID, "f-learning_rate")
    lr.clear()
    lr.send_keys("-1")
    browser.find_element(By.ID, "save-btn").click()
    error = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '.field[data-field="learning_rate"] .error'))
    assert error[0].text.startswith("--learning_rate -1: expected a number in [0, 10]")

    # fixed, and fewer steps: accepted and written to the job's config.toml
    lr.clear()
    lr.send_keys("0.002")
    steps = browser.find_element(By.ID, "f-max_train_steps")
    steps.clear()
    steps.send_keys("400")  # long enough that Stop arrives mid-run on a quiet machine too (40 steps took 6 s)
    tab(browser, "Sampling")
    every = browser.find_element(By.ID, "f-sample_every_n_steps")
    every.send_keys("5")
    assert browser.find_element(By.ID, "no-prompts").is_displayed()
    browser.find_element(By.ID, "add-prompt").click()
    browser.find_element(By.CSS_SELECTOR, "#prompt-list input").send_keys("a red <circle> --w 64 --h 64 --s 2 --d 1")
    browser.find_element(By.ID, "save-btn").click()
    wait.until(lambda d: d.find_element(By.ID, "form-ok").is_displayed())
    assert not browser.find_elements(By.CSS_SELECTOR, ".field .error")
    config = open(os.path.join(app.state.runner.jobs_dir, "1", "config.toml")).read()
    assert "learning_rate = 0.002" in config and "max_train_steps = 400" in config
    with open(os.path.join(app.state.runner.jobs_dir, "1", "prompts.txt")) as f:
        assert f.read() == "a red <circle> --w 64 --h 64 --s 2 --d 1\n"
    _performance_folders_strategy_history(browser, wait, url, app, shots)

    # start: the console streams the log, the header shows the progress
    browser.find_element(By.ID, "start-btn").click()
    wait.until(lambda d: "running" in d.find_element(By.ID, "job-status").text)
    slow = WebDriverWait(browser, 150, poll_frequency=0.3)
    slow.until(lambda d: "LoRA modules" in d.find_element(By.ID, "console").text)
    slow.until(lambda d: d.find_element(By.ID, "progress").text.startswith("step ")
               and not d.find_element(By.ID, "progress").text.startswith("step 0 "))
    assert "$ cd " in browser.find_element(By.ID, "console").text
    slow.until(lambda d: "steps:" in d.find_element(By.ID, "console").text)
    assert browser.find_element(By.CSS_SELECTOR, "#tabs a.active").text == "Run"  # Start opens the Run tab
    # the loss chart (uPlot): axes named step / loss / learning rate, and hover values
    slow.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chart .uplot canvas"))
    slow.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chart .u-legend .u-series")) >= 4)
    _chart_has_axes_and_hover(browser)
    tab(browser, "Outputs")
    browser.execute_script("window.scrollTo(0, 0)")
    slow.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#samples table.gallery img"))  # a sample, from the prompt
    assert not browser.find_element(By.ID, "no-samples").is_displayed()
    heads = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "#samples table.gallery tr:first-child th")]
    assert heads == ["step \u00d7 prompt", "0: a red <circle>"]
    label = browser.find_element(By.CSS_SELECTOR, "#samples table.gallery th.row-label").text
    assert label.startswith("step ") and int(label.split()[1]) % 5 == 0
    link = browser.find_element(By.CSS_SELECTOR, "#samples table.gallery td a")
    assert link.get_attribute("target") == "_blank" and link.get_attribute("href").endswith(".png")
    os.makedirs(shots, exist_ok=True)
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(os.path.join(shots, "webui_samples.png"))
    tab(browser, "Run")
    _chart_has_axes_and_hover(browser)
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(os.path.join(shots, "webui_job.png"))

    # 50 concurrent API calls while the job trains: no errors
    paths = ["/api/jobs", "/api/jobs/1", "/api/jobs/1/status", "/api/jobs/1/samples", "/api/jobs/1/settings"]

    def call(i):
        with urllib.request.urlopen(url + paths[i % len(paths)], timeout=60) as r:
            return r.status

    with ThreadPoolExecutor(50) as pool:
        statuses = list(pool.map(call, range(50)))
    assert statuses == [200] * 50
    assert "running" in browser.find_element(By.ID, "job-status").text

    # stop: SIGINT, the trainer saves a state and the job is "stopped"
    browser.find_element(By.ID, "stop-btn").click()
    slow.until(lambda d: "stopped" in d.find_element(By.ID, "job-status").text)
    slow.until(lambda d: "state saved to" in d.find_element(By.ID, "console").text)
    assert browser.find_element(By.ID, "start-btn").text == "Resume"
    wait.until(lambda d: d.find_element(By.ID, "job-status").value_of_css_property("color") == "rgba(255, 255, 255, 1)")

    # delete the job's TensorBoard event files (after a confirmation)
    tab(browser, "Outputs")
    browser.find_element(By.ID, "delete-events-btn").click()
    browser.switch_to.alert.accept()
    wait.until(lambda d: "event file(s) deleted" in d.find_element(By.ID, "events-msg").text)
    logs_dir = os.path.join(app.state.runner.jobs_dir, "1", "output", "logs")
    assert not [n for _, _, files in os.walk(logs_dir) for n in files if n.startswith("events.out.tfevents.")]


def _chart_has_axes_and_hover(browser):
    axes = browser.execute_script("return chart.axes.map((a) => a.label)")  # uPlot draws them on its canvas
    assert axes == ["step", "loss", "learning rate"], axes
    assert browser.execute_script("return chart.series.map((s) => s.label)")[:4] == [
        "step", "loss", "loss (smoothed)", "LR"]
    over = browser.find_element(By.CSS_SELECTOR, "#chart .u-over")
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element(over).perform()  # hover: the legend shows the step's values
    values = [v.text for v in browser.find_elements(By.CSS_SELECTOR, "#chart .u-legend .u-series .u-value")]
    assert values[0].isdigit() and all(v not in ("", "--") for v in values[1:4]), values


def _performance_folders_strategy_history(browser, wait, url, app, shots):
    """Performance options this machine cannot use are disabled with the server's reason; a second dataset folder
    and a strategy (here, without GPUs, the single-process one on the CPU) saved at once: dataset.toml has two subsets and the
    accelerate config is written; then the settings history restores the save before."""
    import json

    import yaml

    job = os.path.join(app.state.runner.jobs_dir, "1")
    with urllib.request.urlopen(url + "/api/jobs/1/performance") as r:
        reasons = {o["key"]: o["reason"] for o in json.load(r)}
    tab(browser, "Performance")
    flash = browser.find_element(By.CSS_SELECTOR, '.field[data-perf="flash_attn"]')
    assert not flash.find_element(By.TAG_NAME, "input").is_enabled()
    assert reasons["flash_attn"] and flash.find_element(By.CSS_SELECTOR, ".reason").text == reasons["flash_attn"]
    swap = browser.find_element(By.CSS_SELECTOR, '.field[data-perf="blocks_to_swap"]')
    assert swap.find_element(By.CSS_SELECTOR, ".reason").text.startswith("not supported for sd (DiT families only")
    persistent = browser.find_element(By.CSS_SELECTOR, '.field[data-perf="persistent_data_loader_workers"]')
    assert persistent.find_element(By.CSS_SELECTOR, ".reason").text == "needs data-loader workers > 0"  # 0 workers
    workers = browser.find_element(By.ID, "f-max_data_loader_n_workers")
    workers.clear()
    workers.send_keys("2\t")  # leaves the field: its change event
    wait.until(lambda d: persistent.find_element(By.TAG_NAME, "input").is_enabled())
    workers.clear()
    workers.send_keys("0\t")
    wait.until(lambda d: not persistent.find_element(By.TAG_NAME, "input").is_enabled())

    tab(browser, "Data")
    browser.find_element(By.ID, "add-folder").click()
    row = browser.find_element(By.CSS_SELECTOR, '#folder-rows .folder-row[data-index="1"]')
    assert row.find_element(By.CSS_SELECTOR, ".folder-title").text == "Folder 2"
    row.find_element(By.CSS_SELECTOR, ".image-dir").send_keys("examples/data/train/10_sks shape")
    repeats = row.find_element(By.CSS_SELECTOR, '[data-sub="num_repeats"]')
    repeats.clear()  # leaving the folder field shows its image count and thumbnails
    repeats.send_keys("2")
    row.find_element(By.CSS_SELECTOR, '[data-sub="class_tokens"]').send_keys("shape")
    wait.until(lambda d: row.find_element(By.CSS_SELECTOR, ".folder-info").text == "7 image(s)")
    assert len(row.find_elements(By.CSS_SELECTOR, ".thumbs img")) == 7

    tab(browser, "Multi-GPU")
    details = browser.find_element(By.ID, "strategy-details")
    assert details.text == "Select a strategy to see details"
    strategy = Select(browser.find_element(By.ID, "f-strategy"))
    assert [o.text for o in strategy.options if not o.is_enabled()] == [  # no GPU: one process, on the CPU
        "DDP (data parallel) (needs GPUs)", "FSDP1 (fully sharded, v1) (needs GPUs)",
        "FSDP2 (fully sharded, per-parameter) (needs GPUs)", "DeepSpeed ZeRO (needs GPUs)"]
    strategy.select_by_value("single")
    assert "One process on one GPU (or the CPU)" in details.text
    assert "No GPU: one process on the CPU (accelerate --cpu)" in details.text
    tab(browser, "Performance")
    browser.find_element(By.ID, "f-profile_steps").click()  # Diagnostics: the trainer's --profile_steps
    browser.find_element(By.ID, "save-btn").click()
    wait.until(lambda d: d.find_element(By.ID, "form-ok").is_displayed())
    subsets = toml.load(os.path.join(job, "dataset.toml"))["datasets"][0]["subsets"]
    assert [(s["image_dir"], s["num_repeats"], s.get("class_tokens")) for s in subsets] == [
        ("examples/data/train/10_sks shape", 1, "sks shape"), ("examples/data/train/10_sks shape", 2, "shape")]
    with open(os.path.join(job, "accelerate_config.yaml")) as f:
        accelerate = yaml.safe_load(f)
    assert (accelerate["distributed_type"], accelerate["num_processes"], accelerate["use_cpu"]) == ("NO", 1, True)
    assert toml.load(os.path.join(job, "config.toml"))["diagnostics"] == {"profile_steps": True}
    assert f"accelerate launch --config_file {job}/accelerate_config.yaml train_network.py --config_file " \
        in browser.find_element(By.ID, "command").get_attribute("textContent")
    browser.set_window_size(1400, 1500)  # the Performance options in one picture
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(os.path.join(shots, "webui_settings.png"))
    tab(browser, "Multi-GPU")
    browser.save_screenshot(os.path.join(shots, "webui_multigpu.png"))
    browser.set_window_size(1400, 1000)

    # the settings history: newest first; Restore brings back the save before (one folder, no strategy)
    tab(browser, "Run")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#history li")) == 3)
    items = browser.find_elements(By.CSS_SELECTOR, "#history li")
    assert [i.get_attribute("data-revision") for i in items] == ["3", "2", "1"]
    assert items[0].find_element(By.CSS_SELECTOR, ".what").text == (
        "profile_steps: set to true; subsets[1].class_tokens: set to shape; subsets[1].image_dir: set to examples/data/"
        "train/10_sks shape; subsets[1].num_repeats: set to 2; strategy: set to single")
    items[1].find_element(By.CSS_SELECTOR, ".restore-btn").click()
    browser.switch_to.alert.accept()
    wait.until(lambda d: d.find_element(By.ID, "form-ok").text.startswith("Restored revision 2. max_train_steps 400 "
                                                                          "governs"))
    assert len(toml.load(os.path.join(job, "dataset.toml"))["datasets"][0]["subsets"]) == 1
    assert not os.path.exists(os.path.join(job, "accelerate_config.yaml"))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#folder-rows .folder-row")) == 1  # drawn, in its tab
    assert browser.find_element(By.ID, "f-strategy").get_attribute("value") == ""
    assert "python train_network.py --config_file" in browser.find_element(By.ID, "command").get_attribute("textContent")
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#history li .what").text.startswith(
        "restored revision 2: profile_steps: removed (was true); "))


def test_anima_finetune_keeps_the_llm_adapter_frozen(server, browser, monkeypatch):
    """An Anima full fine-tune job: the Anima model fields (no CLIP-L), the DiT / LLM adapter / Qwen3 rows, and
    "Keep the LLM adapter weights frozen during training" ticked: the server holds llm_adapter_lr = 0, accepted by
    anima_train.py's own --check_config, and the re-drawn form shows the box ticked."""
    from webui import performance

    flags = frozenset(o[0] for o in performance.OPTIONS) | set(performance.MEMORY_FLAGS)  # not --help: faster
    monkeypatch.setattr(performance, "trainer_flags", lambda script, timeout=120: flags)
    url, app = server
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)
    browser.get(url + "/")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#template-select option[value="anima_finetune"]'))
    Select(browser.find_element(By.ID, "template-select")).select_by_value("anima_finetune")
    browser.find_element(By.ID, "create-btn").click()
    wait.until(lambda d: d.find_elements(By.ID, "f-llm_adapter_frozen"))
    assert "python anima_train.py --config_file" in browser.find_element(By.ID, "command").get_attribute("textContent")
    assert browser.find_element(By.ID, "f-qwen3").get_attribute("value") == "/models/qwen_3_06b_base.safetensors"
    assert browser.find_elements(By.ID, "f-vae") and browser.find_elements(By.ID, "f-llm_adapter_path")
    assert not browser.find_elements(By.ID, "f-clip_l") and not browser.find_elements(By.ID, "f-network_dim")
    rows = browser.find_elements(By.CSS_SELECTOR, "table.components tr td:first-child")
    assert [r.text for r in rows] == ["DiT", "LLM adapter", "Text encoder (Qwen3)"]
    frozen = browser.find_element(By.ID, "f-llm_adapter_frozen")
    assert browser.find_element(By.CSS_SELECTOR, 'label[for="f-llm_adapter_frozen"]').text.startswith(
        "Keep the LLM adapter weights frozen during training")
    assert not frozen.is_selected() and browser.find_element(By.ID, "f-llm_adapter_lr").is_enabled()

    # Start waits for a clean check: the template's model paths are placeholders, marked "to fill in"
    wait.until(lambda d: d.find_element(By.ID, "start-reason").is_displayed())
    assert not browser.find_element(By.ID, "start-btn").is_enabled()
    marked = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".field.placeholder-field"))
    assert {m.get_attribute("data-field") for m in marked} >= {"pretrained_model_name_or_path", "qwen3", "vae"}
    assert marked[0].find_element(By.CSS_SELECTOR, ".to-fill").text == "to fill in: the template's placeholder path"
    tab(browser, "Data")
    folder = browser.find_element(By.CSS_SELECTOR, '#folder-rows .folder-row[data-index="0"] .image-dir')
    folder.clear()
    folder.send_keys("examples/data/train/10_sks shape")
    tab(browser, "Model")
    model = browser.find_element(By.ID, "f-pretrained_model_name_or_path")
    model.clear()
    model.send_keys("/models/nope.safetensors")
    browser.find_element(By.ID, "save-btn").click()  # refused at the field (before: "Saved", then Start failed)
    error = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '.field[data-field="pretrained_model_name_or_path"] .error'))
    assert error[0].text == "pretrained_model_name_or_path /models/nope.safetensors: no such file or folder"
    model.clear()
    model.send_keys("tiny:anima")  # the built-in tiny model: the template's /models/... file is not here
    for key in ("qwen3", "vae"):  # the tiny model holds them
        browser.find_element(By.ID, f"f-{key}").clear()
    tab(browser, "Training")
    browser.find_element(By.ID, "f-optimizer_type").clear()
    browser.find_element(By.ID, "f-optimizer_type").send_keys("AdamW")  # no bitsandbytes needed
    tab(browser, "Model")
    frozen.click()
    assert not browser.find_element(By.ID, "f-llm_adapter_lr").is_enabled()
    browser.find_element(By.ID, "save-btn").click()
    wait.until(lambda d: any(e.is_displayed() for e in d.find_elements(By.CSS_SELECTOR, "#form-ok, .error")))
    errors = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".error")]
    assert browser.find_element(By.ID, "form-ok").is_displayed(), errors
    config = toml.load(os.path.join(app.state.runner.jobs_dir, "1", "config.toml"))
    assert config["optimizer"]["llm_adapter_lr"] == 0
    assert config["model"]["pretrained_model_name_or_path"] == "tiny:anima"
    assert browser.find_element(By.ID, "f-llm_adapter_frozen").is_selected()  # the form, drawn again from the server
    # the steps / epochs rule, named at Save and beside the fields (the template trains 10 epochs)
    wait.until(lambda d: "max_train_epochs 10 governs" in d.find_element(By.ID, "form-ok").text)
    wait.until(lambda d: browser.find_element(By.ID, "start-btn").is_enabled())
    assert not browser.find_element(By.ID, "start-reason").is_displayed()
    tab(browser, "Training")
    note = browser.find_element(By.CSS_SELECTOR, '.field[data-field="max_train_epochs"] .run-length').text
    assert note == "governs the run's length"
    browser.save_screenshot(os.path.join(os.environ.get("WEBUI_SHOTS", "/tmp"), "webui_anima_training.png"))


def test_data_folders_upload_and_the_raw_editor(server, browser, tmp_path, tiny_wd14):  # noqa: F811
    """Data tab: a folder added from the page is allowed on the server at once; files dropped on the drop zone
    land in the job's dataset folder; Caption images runs the toolkit's WD14 tagger (a tiny ONNX one) on a folder
    and the tags are written beside the images. Model tab: config.toml edited as text is checked and written. A
    second job of the same name gets " (2)"."""
    url, app = server
    wait = WebDriverWait(browser, 90, poll_frequency=0.2)
    extra = tmp_path / "more_images"
    (extra / "sub").mkdir(parents=True)
    (extra / "sub" / "a.png").write_bytes(b"\x89PNG")
    browser.get(url + "/")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#template-select option[value="tiny_sd1_lora"]'))
    for _ in range(2):
        browser.find_element(By.ID, "new-name").send_keys("tiny lora A")
        browser.find_element(By.ID, "create-btn").click()
        wait.until(lambda d: d.find_elements(By.ID, "f-network_dim"))  # the form of the new job, drawn
        wait.until(lambda d: d.find_element(By.ID, "job-name").text.startswith("tiny lora A"))
    wait.until(lambda d: d.find_element(By.ID, "job-name").text == "tiny lora A (2)")
    assert [j["name"] for j in app.state.store.jobs()] == ["tiny lora A", "tiny lora A (2)"]

    tab(browser, "Data")
    browser.find_element(By.ID, "root-path").send_keys(str(extra))
    browser.find_element(By.ID, "root-add").click()
    wait.until(lambda d: str(extra) in d.find_element(By.ID, "roots-list").text)
    assert str(extra) in app.state.ctx.roots.roots
    browser.execute_script("""
        const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array([137, 80, 78, 71])], "dropped.png", { type: "image/png" }));
        dt.items.add(new File(["a sks shape"], "dropped.txt", { type: "text/plain" }));
        const zone = document.getElementById("drop-zone");
        zone.dispatchEvent(new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true }));""")
    wait.until(lambda d: "2 file(s) uploaded" in d.find_element(By.ID, "upload-msg").text)
    dataset = os.path.join(app.state.runner.jobs_dir, "2", "dataset")
    assert sorted(os.listdir(dataset)) == ["dropped.png", "dropped.txt"]

    from PIL import Image

    pics = extra / "pics"
    pics.mkdir()
    Image.new("RGB", (64, 64), (255, 0, 0)).save(pics / "red.png")
    app.state.ctx.roots.add(tiny_wd14)
    browser.find_element(By.ID, "cap-folder").send_keys(str(pics))
    Select(browser.find_element(By.ID, "cap-captioner")).select_by_value("wd14")
    browser.find_element(By.ID, "cap-model").send_keys(tiny_wd14)
    browser.find_element(By.ID, "cap-start").click()
    WebDriverWait(browser, 150, poll_frequency=0.3).until(
        lambda d: d.find_element(By.ID, "cap-msg").text.startswith("finished"))
    assert browser.find_element(By.ID, "cap-msg").text == f"finished: 1 of 1 image(s) have a .txt file ({pics})"
    assert (pics / "red.txt").read_text() == "red_hair, smile, ^_^, hatsune_miku_(vocaloid)\n"  # threshold 0.35

    tab(browser, "Model")
    browser.find_element(By.ID, "raw-load").click()
    raw = wait.until(lambda d: d.find_element(By.ID, "raw-config").get_attribute("value"))
    assert "max_train_steps = 20" in raw
    browser.execute_script("document.getElementById('raw-config').value = arguments[0]",
                           raw.replace("max_train_steps = 20", "max_train_steps = 9"))
    browser.find_element(By.ID, "raw-save").click()
    msg = wait.until(lambda d: d.find_element(By.ID, "raw-msg").text)
    assert msg == "Saved: every check Start makes passed."
    assert toml.load(os.path.join(app.state.runner.jobs_dir, "2", "config.toml"))["training"]["max_train_steps"] == 9
    browser.save_screenshot(str(tmp_path / "raw.png"))
    tab(browser, "Data")
    browser.save_screenshot(os.path.join(os.environ.get("WEBUI_SHOTS", str(tmp_path)), "webui_data.png"))
