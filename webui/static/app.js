// The training-job page: plain DOM, no build step. User text is only ever set with textContent / value.
"use strict";


let TOKEN_QS = "";
let current = null;      // the selected job
let settings = null;     // its settings as last loaded
let source = null;       // the console's EventSource
let pollTimer = null;
let chartTick = 0;       // the chart is redrawn every 5th status poll while a job runs

const $ = (id) => document.getElementById(id);
function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  if (text !== undefined) e.textContent = text;
  return e;
}

async function api(method, path, body) {
  const opts = { method, headers: {} };
  if (body !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(body); }
  const r = await fetch(path, opts);
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  if (!r.ok) {
    const detail = data && data.detail !== undefined ? data.detail : r.statusText;
    const err = new Error(typeof detail === "string" ? detail : (detail.error || JSON.stringify(detail)));
    err.status = r.status; err.detail = detail;
    throw err;
  }
  return data;
}

// --- sidebar ---------------------------------------------------------------------------------------
async function loadTemplates() {
  const list = await api("GET", "/api/templates");
  const sel = $("template-select");
  sel.textContent = "";
  for (const t of list) sel.appendChild(el("option", { value: t.name }, t.title));
  const tiny = list.find((t) => t.name === "tiny_sd1_lora");
  if (tiny) sel.value = tiny.name;
}

async function loadJobs() {
  const jobs = await api("GET", "/api/jobs");
  const ul = $("job-list");
  ul.textContent = "";
  $("no-jobs").hidden = jobs.length > 0;
  for (const j of jobs) {
    const li = el("li", { "data-id": String(j.id) });
    if (current && current.id === j.id) li.classList.add("selected");
    li.appendChild(el("span", { class: "name", title: j.name }, j.name));
    li.appendChild(el("span", { class: "status " + j.status }, j.status));
    li.addEventListener("click", () => selectJob(j.id));
    ul.appendChild(li);
  }
  return jobs;
}

async function createJob() {
  const body = { template: $("template-select").value };
  const name = $("new-name").value.trim();
  if (name) body.name = name;
  const job = await api("POST", "/api/jobs", body);
  $("new-name").value = "";
  await loadJobs();
  await selectJob(job.id);
}

// --- job view ----------------------------------------------------------------------------------------
async function selectJob(id) {
  const job = await api("GET", `/api/jobs/${id}`);
  current = job;
  $("empty-state").hidden = true;
  $("job-view").hidden = false;
  startCheck = null;
  $("raw-editor").hidden = true; $("upload-msg").textContent = "";
  showJob(job);
  showTab(job.status === "running" || job.status === "queued" ? "Run" : "Model");
  await loadFormData(job);
  renderForm();
  clearErrors();
  loadCheck();
  loadHistory();
  openConsole(true);
  loadSamples();
  loadTrained();
  loadTensorBoard();
  loadChart();
  loadHardware();
  loadRoots();
  $("events-msg").textContent = "";
  $("control-msg").textContent = "";
  await loadJobs();
}

const MODE_LABELS = { lora: "LoRA", finetune: "Full Finetune", controlnet: "ControlNet", controlnet_lllite: "ControlNet-LLLite",
  textual_inversion: "Textual Inversion" };
function showJob(job) {
  $("job-name").textContent = job.name;
  const st = $("job-status");
  st.textContent = job.status; st.className = "status " + job.status;
  $("job-kind").textContent = `${job.family} · ${MODE_LABELS[job.mode] || job.mode} · ${job.script}`;
  $("command").textContent = job.command;
  $("job-folder").textContent = job.folder;
  const active = job.status === "running" || job.status === "queued";
  const blocked = checking || (startCheck && !startCheck.ok);
  $("start-btn").disabled = active || blocked || busyNow;
  // Resume only when a run saved a state to resume from (a start that failed before any step says Start)
  $("start-btn").textContent = job.resumable && (job.status === "stopped" || job.status === "failed") ? "Resume" : "Start";
  $("start-reason").hidden = active || !blocked;
  if (blocked) $("start-reason").textContent = checking ? "Checking whether Start will work..."
    : "Start needs a clean check: " + startCheck.error;
  $("stop-btn").disabled = !active;
  $("sample-now-btn").disabled = job.status !== "running";
  $("save-now-btn").disabled = job.status !== "running";
  $("save-btn").disabled = active || busyNow;
  $("delete-btn").disabled = active;
  const q = job.queue;
  $("queue-line").hidden = !q;
  if (q) $("queue-line").textContent = `Queued: position ${q.position} of ${q.of}; waits for ${q.waits_for}`;
}

// --- the sticky bar: busy state, the start check ---------------------------------------------------------------
let busyNow = false;
let startCheck = null;   // GET /check: does Start work with the saved files?
let checking = false;
function setBusy(on, text) {
  busyNow = on;
  $("busy").hidden = !on;
  if (text) $("busy-text").textContent = text;
  if (current) showJob(current);
}
async function loadCheck() {
  if (!current) return;
  const id = current.id;
  checking = true; showJob(current);
  try { startCheck = await api("GET", `/api/jobs/${id}/check`); } finally { checking = false; }
  if (!current || current.id !== id) return;
  showJob(current);
  showCheckMarks();
}
// Placeholders "to fill in", the steps / epochs rule beside those fields
function showCheckMarks() {
  for (const e of document.querySelectorAll(".to-fill, .run-length")) e.remove();
  for (const e of document.querySelectorAll(".placeholder-field")) e.classList.remove("placeholder-field");
  if (!startCheck) return;
  for (const key of startCheck.placeholders) {
    const f = document.querySelector(`#sections [data-field="${key}"]`);
    if (!f) continue;
    f.classList.add("placeholder-field");
    f.appendChild(el("p", { class: "to-fill" }, "to fill in: the template's placeholder path"));
  }
  const rl = startCheck.run_length;
  for (const key of ["max_train_steps", "max_train_epochs"]) {
    const f = document.querySelector(`#sections [data-field="${key}"]`);
    if (!f) continue;
    const governs = rl.governs === key;
    const overridden = !governs && rl.overridden === key;
    f.appendChild(el("p", { class: "run-length " + (governs ? "governs" : overridden ? "overridden" : "muted") },
      governs ? "governs the run's length" : (rl.governs === "max_train_epochs" ? "overridden by Epochs (sd-scripts' rule)" : "blank: Max steps governs")));
  }
  const sched = document.querySelector('#sections fieldset[data-section="Training Schedule"]');
  if (sched) sched.appendChild(el("p", { class: "run-length note" }, rl.note));
}
function afterRender() { showTab(currentTab); showCheckMarks(); }
function onSettingsSaved() {  // form.js calls it after a Save or a Restore the server accepted
  loadCheck().then(() => {
    if (startCheck && startCheck.run_length) {
      $("form-ok").textContent = `${$("form-ok").textContent} ${startCheck.run_length.note}.`;
    }
  });
}
function onSettingsError(field) {  // a refused save: show the tab that holds the field
  const target = field && document.querySelector(`#sections [data-field="${field}"]`);
  const fs = target && target.closest("[data-tab]");
  if (fs) showTab(fs.getAttribute("data-tab"));
}

// --- tabs ----------------------------------------------------------------------------------------------------
const SECTION_TABS = {
  "Model and mode": "Model", "LoRA Configuration": "Model", "Full Finetune Options": "Model",
  "Dataset Folders": "Data", "Global Dataset Settings": "Data", "Bucketing": "Data", "Caching": "Data",
  "Optimization": "Training", "Training Schedule": "Training", "Resume": "Training",
  "Performance": "Performance", "Diagnostics": "Performance",
  "Hardware Allocation": "Multi-GPU", "Multi-GPU Optimization": "Multi-GPU", "Sampling": "Sampling",
};
let currentTab = "Model";
function tagSections() {
  for (const fs of document.querySelectorAll("#sections fieldset[data-section]")) {
    fs.setAttribute("data-tab", SECTION_TABS[fs.getAttribute("data-section")] || "Training");
  }
}
function showTab(name) {
  currentTab = name;
  tagSections();
  for (const e of document.querySelectorAll("#job-view [data-tab]:not(#tabs a)")) e.hidden = e.getAttribute("data-tab") !== name;
  $("settings-form").hidden = ["Run", "Outputs"].includes(name);
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.getAttribute("data-tab") === name);
  if (name === "Run" && chart) chart.setSize(chartSize());
}

async function pollStatus() {
  if (!current) return;
  try {
    const s = await api("GET", `/api/jobs/${current.id}/status`);
    const changed = s.status !== current.status;
    current.status = s.status;
    if (changed || s.status === "queued") current = await api("GET", `/api/jobs/${current.id}`);
    showJob(current);
    if (s.status === "running" || changed) loadHardware();
    const p = s.progress;
    if (p) {
      const parts = [`step ${p.step} / ${p.total} (${p.percent}%)`, `elapsed ${p.elapsed}`, `ETA ${p.eta}`];
      if (p.loss !== undefined) parts.push(`loss ${p.loss}`);
      if (p.lr !== undefined) parts.push(`LR ${p.lr}`);
      if (p.rate) parts.push(p.rate);
      $("progress").textContent = parts.join(" · ");
      if ((s.status === "running" && chartTick++ % 5 === 0) || changed) { loadChart(); loadSamples(); loadTrained(); }
    }
    if (changed) { loadJobs(); loadSamples(); loadTrained(); }
  } catch (e) { /* the server restarts: try again next time */ }
}

// --- console -------------------------------------------------------------------------------------------
function openConsole(reset) {
  if (source) { source.close(); source = null; }
  const con = $("console");
  if (reset) { con.textContent = ""; $("progress").textContent = "No progress yet."; }
  source = new EventSource(`/api/jobs/${current.id}/log`);
  const jobId = current.id;
  source.addEventListener("waiting", (ev) => { if (!con.textContent) con.textContent = ev.data + "\n"; });
  source.onmessage = (ev) => {
    if (!current || current.id !== jobId) return;
    if (con.textContent.startsWith("Waiting for training")) con.textContent = "";
    for (const line of ev.data.split("\n")) appendLine(con, line);
    con.scrollTop = con.scrollHeight;
  };
  source.addEventListener("bar", (ev) => {
    if (!current || current.id !== jobId) return;
    appendLine(con, ev.data);
    con.scrollTop = con.scrollHeight;
  });
  source.addEventListener("end", () => { source.close(); source = null; pollStatus(); });
}

function appendLine(con, line) {
  // tqdm redraws its bar with \r: a bar line replaces the bar line before it
  const isBar = line.startsWith("steps:");
  const last = con.lastChild;
  if (isBar && last && last.nodeType === 1 && last.classList.contains("bar")) { last.textContent = line + "\n"; return; }
  const span = el("span", isBar ? { class: "bar" } : {}, line + "\n");
  con.appendChild(span);
}

// The gallery: a row per step (or epoch, or test generation), a column per prompt, like ai-toolkit's grid;
// a click opens the full-size image. The grid images the trainer also writes are left out.
async function loadSamples() {
  if (!current) return;
  const list = (await api("GET", `/api/jobs/${current.id}/samples`)).filter((s) => !s.grid);
  const box = $("samples");
  box.textContent = "";
  $("no-samples").hidden = list.length > 0;
  if (!list.length) return;
  const rowKey = (s) => s.generated ? `generated ${new Date(s.mtime * 1000).toLocaleTimeString()}`
    : s.step !== null ? `step ${s.step}` : s.epoch !== null ? `epoch ${s.epoch}` : s.name;
  const rows = new Map(), prompts = new Map();
  for (const s of list) {
    const r = rowKey(s);
    if (!rows.has(r)) rows.set(r, new Map());
    const col = s.prompt_index === null ? 0 : s.prompt_index;
    rows.get(r).set(col, s);
    if (!prompts.has(col) || (!prompts.get(col) && s.prompt)) prompts.set(col, s.prompt || `prompt ${col}`);
  }
  const cols = [...prompts.keys()].sort((a, b) => a - b);
  const table = el("table", { class: "gallery" });
  const head = el("tr");
  head.appendChild(el("th", {}, "step \u00d7 prompt"));
  for (const c of cols) head.appendChild(el("th", { title: prompts.get(c) }, `${c}: ${prompts.get(c)}`));
  table.appendChild(head);
  for (const [r, cells] of rows) {
    const tr = el("tr");
    tr.appendChild(el("th", { class: "row-label" }, r));
    for (const c of cols) {
      const td = el("td");
      const s = cells.get(c);
      if (s) {
        const url = `/api/jobs/${current.id}/files/${s.path.split("/").map(encodeURIComponent).join("/")}`;
        const a = el("a", { href: url, target: "_blank", rel: "noopener", title: `${r} \u00d7 ${prompts.get(c)}` });
        a.appendChild(el("img", { src: url, alt: `${r}, prompt ${c}` }));
        td.appendChild(a);
      }
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
  box.appendChild(table);
}

async function loadTrained() {
  if (!current) return;
  $("maint-folder").textContent = current.folder;
  const list = await api("GET", `/api/jobs/${current.id}/trained`);
  const ul = $("trained");
  ul.textContent = "";
  $("no-trained").hidden = list.length > 0;
  const sel = $("gen-checkpoint");
  sel.textContent = "";
  for (const f of list) sel.appendChild(el("option", { value: f.name }, f.name));
  if (!list.length) sel.appendChild(el("option", { value: "" }, current.mode === "finetune" ? "the base model" : "no trained network yet"));
  for (const f of list) {
    const li = el("li");
    const url = `/api/jobs/${current.id}/files/${f.path.split("/").map(encodeURIComponent).join("/")}`;
    li.appendChild(el("a", { href: url, download: f.name }, f.name));
    li.appendChild(el("span", { class: "muted" }, ` ${(f.size / 1048576).toFixed(1)} MiB`));
    ul.appendChild(li);
  }
}

function showTensorBoard(tb) {
  $("tb-status").textContent = tb.status;
  $("tb-link").hidden = !tb.running;
  if (tb.url) $("tb-link").href = tb.url;
  $("tb-start").disabled = tb.running;
  $("tb-stop").disabled = !tb.running;
  $("tb-logdir").textContent = tb.logdir || "";
  $("tb-command").textContent = tb.command || "";
}
async function loadTensorBoard() {
  if (current) showTensorBoard(await api("GET", `/api/jobs/${current.id}/tensorboard`));
}

// --- the loss chart (uPlot, webui/static/vendor/uplot): loss and its smoothed line, validation loss, LR on its own
// axis; hover shows the values of a step ---------------------------------------------------------------------------
let chart = null, chartPoints = [];
function chartSize() { return { width: Math.max(300, $("chart").clientWidth || 800), height: 260 }; }
function smoothed(values, alpha) {  // TensorBoard's exponential moving average, debiased
  let last = 0, n = 0;
  return values.map((v) => {
    if (v === null || !isFinite(v)) return null;
    last = last * alpha + (1 - alpha) * v; n++;
    return last / (1 - Math.pow(alpha, n));
  });
}
function drawChart() {
  const box = $("chart");
  const pts = chartPoints;
  const shown = pts.filter((p) => typeof p.loss === "number").length >= 2;
  $("chart-tools").hidden = !shown;
  if (chart) { chart.destroy(); chart = null; }
  box.textContent = "";
  if (!shown) return;
  const alpha = Number($("chart-smooth").value);
  $("chart-smooth-value").textContent = alpha.toFixed(2);
  const log = $("chart-log").checked;
  const steps = pts.map((p) => p.step);
  const loss = pts.map((p) => (typeof p.loss === "number" ? p.loss : null));
  const val = pts.map((p) => (typeof p.val_loss === "number" ? p.val_loss : null));
  const lr = pts.map((p) => (typeof p.lr === "number" ? p.lr : null));
  const hasVal = val.some((v) => v !== null);
  const series = [{ label: "step" },
    { label: "loss", stroke: "rgba(48,96,208,0.35)", width: 1, scale: "loss", value: (u, v) => v === null ? "-" : v.toFixed(4) },
    { label: "loss (smoothed)", stroke: "#3060d0", width: 2, scale: "loss", value: (u, v) => v === null ? "-" : v.toFixed(4) },
    { label: "LR", stroke: "#d08a30", width: 1.5, dash: [5, 4], scale: "lr", value: (u, v) => v === null ? "-" : v.toExponential(2) }];
  const data = [steps, loss, smoothed(loss, alpha), lr];
  if (hasVal) {
    series.push({ label: "validation loss", stroke: "#c0392b", width: 2, scale: "loss", spanGaps: true,
      points: { show: true, size: 6 }, value: (u, v) => v === null ? "-" : v.toFixed(4) });
    data.push(val);
  }
  chart = new uPlot({
    ...chartSize(),
    cursor: { drag: { x: true, y: false } },
    scales: { x: { time: false }, loss: log ? { distr: 3 } : {}, lr: { auto: true, range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },
    axes: [{ label: "step" },
      { scale: "loss", label: "loss", size: 70 },
      { scale: "lr", label: "learning rate", side: 1, size: 70, grid: { show: false }, values: (u, v) => v.map((x) => x.toExponential(1)) }],
    series,
  }, data, box);
}
async function loadChart() {
  if (!current) return;
  chartPoints = await api("GET", `/api/jobs/${current.id}/history`);
  drawChart();
}

// --- the live hardware panel ----------------------------------------------------------------------------------
async function loadHardware() {
  if (!current) return;
  const hw = await api("GET", `/api/jobs/${current.id}/hardware`);
  const box = $("hw-panel");
  box.textContent = "";
  const lines = [];
  if (hw.cpu && hw.cpu.rss_mib !== null) lines.push(`Run: ${hw.cpu.processes} process(es), ${hw.cpu.rss_mib.toFixed(0)} MiB resident (CPU RAM)`);
  else lines.push(hw.status === "running" ? "Run: starting..." : "No run: the memory of a run shows here while it runs.");
  if (!hw.gpus.length) lines.push("No GPU (nvidia-smi found none): training runs on the CPU.");
  for (const g of hw.gpus) {
    lines.push(`GPU ${g.index} ${g.name}: ${g.memory_used_mib} / ${g.memory_total_mib} MiB, ${g.utilization_percent}% busy`);
  }
  for (const l of lines) box.appendChild(el("div", {}, l));
  box.classList.toggle("muted", hw.status !== "running");
}

// --- generate, sample now, save now ----------------------------------------------------------------------------
let genTimer = null;
async function pollGeneration() {
  if (!current) return;
  const g = await api("GET", `/api/jobs/${current.id}/generate`);
  $("gen-status").textContent = g.status === "idle" ? "" : g.status === "running" ? "Generating..." :
    g.status === "finished" ? "Done: the images are in the samples above." : `Failed (exit code ${g.exit_code}): ${(g.log_tail || "").trim().split("\n").pop()}`;
  $("generate-btn").disabled = g.status === "running";
  if (g.status !== "running") { clearInterval(genTimer); genTimer = null; loadSamples(); }
}
async function generateNow() {
  const body = {};
  const prompts = $("gen-prompts").value.split("\n").map((p) => p.trim()).filter((p) => p);
  if (prompts.length) body.prompts = prompts;
  if ($("gen-checkpoint").value) body.checkpoint = $("gen-checkpoint").value;
  if ($("gen-steps").value) body.steps = Number($("gen-steps").value);
  if ($("gen-seed").value) body.seed = Number($("gen-seed").value);
  await api("POST", `/api/jobs/${current.id}/generate`, body);
  $("gen-status").textContent = "Generating...";
  if (!genTimer) genTimer = setInterval(pollGeneration, 1000);
}

// --- data folders, upload, the raw editor -----------------------------------------------------------------------
async function loadRoots() {
  const r = await api("GET", "/api/data_roots");
  const ul = $("roots-list");
  ul.textContent = "";
  for (const root of r.roots) {
    const li = el("li", {}, root + " ");
    if (r.added.includes(root)) {
      const b = el("button", { type: "button" }, "Remove");
      b.addEventListener("click", () => action(async () => {
        await api("DELETE", `/api/data_roots?path=${encodeURIComponent(root)}`); loadRoots();
      }));
      li.appendChild(b);
    }
    ul.appendChild(li);
  }
  if (current) $("upload-folder").textContent = current.folder + "/dataset";
  if (!$("cap-folder").value) $("cap-folder").placeholder = firstDatasetFolder() || "a dataset folder";
  loadCaptioners();
}
async function loadCaptioners() {
  const sel = $("cap-captioner");
  if (sel.options.length) return;
  for (const c of await api("GET", "/api/captioners")) {
    sel.appendChild(el("option", { value: c.name }, `${c.label}, ${c.extension}`));
  }
}
function firstDatasetFolder() {
  const subs = ((settings && settings.dataset && settings.dataset.datasets) || [])[0];
  const sub = subs && subs.subsets && subs.subsets[0];
  return (sub && sub.image_dir) || "";
}
async function startCaptioning() {
  const body = { folder: $("cap-folder").value.trim() || firstDatasetFolder(), captioner: $("cap-captioner").value,
    model: $("cap-model").value.trim(), recursive: $("cap-recursive").checked, overwrite: $("cap-overwrite").checked };
  if ($("cap-ext").value.trim()) body.caption_extension = $("cap-ext").value.trim();
  let task;
  try { task = await api("POST", "/api/captioning", body); } catch (e) { $("cap-msg").textContent = e.message; return; }
  const show = (t) => { $("cap-msg").textContent = `${t.status}: ${t.captions} of ${t.images} image(s) have a ${t.extension} file (${t.folder})`; };
  show(task);
  while (task.status === "running") {
    await new Promise((ok) => setTimeout(ok, 1000));
    task = await api("GET", `/api/captioning/${task.id}`);
    show(task);
  }
  if (task.status === "failed") $("cap-msg").textContent += ` (${(task.log_tail || "").trim().split("\n").pop()})`;
}
async function uploadFiles(files) {
  let last = null;
  for (const f of files) {
    const r = await fetch(`/api/jobs/${current.id}/dataset_files/${encodeURIComponent(f.name)}`, { method: "PUT", body: f });
    const data = await r.json().catch(() => null);
    if (!r.ok) { $("upload-msg").textContent = `${f.name}: ${data && data.detail ? (data.detail.error || data.detail) : r.statusText}`; return; }
    last = data;
  }
  if (last) $("upload-msg").textContent = `${files.length} file(s) uploaded: ${last.folder} now holds ${last.images} image(s); use it as a dataset folder in Data.`;
}
async function loadRaw() {
  const r = await api("GET", `/api/jobs/${current.id}/raw`);
  $("raw-config").value = r.config; $("raw-dataset").value = r.dataset;
  $("raw-editor").hidden = false; $("raw-msg").textContent = "";
}
async function saveRaw() {
  setBusy(true, "Saving the text: running every check Start makes...");
  try {
    settings = await api("PUT", `/api/jobs/${current.id}/raw`, { config: $("raw-config").value, dataset: $("raw-dataset").value });
    $("raw-msg").className = "ok"; $("raw-msg").textContent = "Saved: every check Start makes passed.";
    renderForm(); loadHistory(); loadCheck();
    current = await api("GET", `/api/jobs/${current.id}`); showJob(current);
  } catch (e) {
    $("raw-msg").className = "error"; $("raw-msg").textContent = e.message;
  } finally { setBusy(false); }
}

async function action(fn) {
  try { await fn(); } catch (e) { alert(e.message); }
}

function init() {
  $("create-btn").addEventListener("click", () => action(createJob));
  $("settings-form").addEventListener("submit", saveSettings);
  $("add-prompt").addEventListener("click", () => addPromptRow(""));
  $("start-btn").addEventListener("click", () => action(async () => {
    const r = await api("POST", `/api/jobs/${current.id}/start`);
    current = r.job; showJob(current); showTab("Run"); openConsole(true); loadJobs();
  }));
  for (const a of document.querySelectorAll("#tabs a")) {
    a.addEventListener("click", (ev) => { ev.preventDefault(); showTab(a.getAttribute("data-tab")); });
  }
  $("chart-log").addEventListener("change", drawChart);
  $("chart-smooth").addEventListener("input", drawChart);
  window.addEventListener("resize", () => { if (chart) chart.setSize(chartSize()); });
  $("generate-btn").addEventListener("click", () => action(generateNow));
  $("root-add").addEventListener("click", () => action(async () => {
    await api("POST", "/api/data_roots", { path: $("root-path").value.trim() });
    $("root-path").value = ""; loadRoots();
  }));
  const zone = $("drop-zone");
  zone.addEventListener("dragover", (ev) => { ev.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (ev) => { ev.preventDefault(); zone.classList.remove("over"); action(() => uploadFiles([...ev.dataTransfer.files])); });
  $("cap-start").addEventListener("click", () => action(startCaptioning));
  $("raw-load").addEventListener("click", () => action(loadRaw));
  $("raw-save").addEventListener("click", () => action(saveRaw));
  $("sample-now-btn").addEventListener("click", () => action(async () => {
    await api("POST", `/api/jobs/${current.id}/sample_now`);
    $("control-msg").textContent = "Sample now: asked; the run samples at its next step.";
  }));
  $("save-now-btn").addEventListener("click", () => action(async () => {
    await api("POST", `/api/jobs/${current.id}/save_now`);
    $("control-msg").textContent = "Save now: asked; the run saves at its next step.";
  }));
  $("stop-btn").addEventListener("click", () => action(async () => {
    const r = await api("POST", `/api/jobs/${current.id}/stop`);
    current = r.job; showJob(current);
  }));
  $("rename-btn").addEventListener("click", () => action(async () => {
    const name = prompt("New name", current.name);
    if (name === null) return;
    current = await api("PATCH", `/api/jobs/${current.id}`, { name });
    showJob(current); loadJobs();
  }));
  $("duplicate-btn").addEventListener("click", () => action(async () => {
    const job = await api("POST", `/api/jobs/${current.id}/duplicate`);
    await loadJobs(); await selectJob(job.id);
  }));
  $("delete-btn").addEventListener("click", () => action(async () => {
    if (!confirm(`Delete the job "${current.name}" and its folder (trained files included)?`)) return;
    await api("DELETE", `/api/jobs/${current.id}?confirm=yes`);
    current = null;
    if (source) { source.close(); source = null; }
    $("job-view").hidden = true; $("empty-state").hidden = false;
    loadJobs();
  }));
  $("revert-btn").addEventListener("click", () => action(async () => {
    if (!confirm("Revert all settings to the template's defaults?")) return;
    settings = await api("POST", `/api/jobs/${current.id}/revert`);
    current = await api("GET", `/api/jobs/${current.id}`);
    showJob(current); renderForm(); showTab(currentTab); clearErrors(); loadHistory(); loadCheck();
  }));
  $("delete-events-btn").addEventListener("click", () => action(async () => {
    if (!confirm("Delete this job's TensorBoard event files?")) return;
    const r = await api("DELETE", `/api/jobs/${current.id}/tensorboard_events?confirm=yes`);
    $("events-msg").textContent = `${r.deleted} event file(s) deleted`;
  }));
  $("open-folder-btn").addEventListener("click", async () => {
    try {
      const r = await api("POST", `/api/jobs/${current.id}/open_folder`);
      $("open-folder-msg").textContent = `opened ${r.opened}`;
    } catch (e) { $("open-folder-msg").textContent = e.message; }  // e.g. the browser is on another machine
  });
  $("tb-start").addEventListener("click", () => action(async () => {
    showTensorBoard(await api("POST", `/api/jobs/${current.id}/tensorboard`));
  }));
  $("tb-stop").addEventListener("click", () => action(async () => {
    showTensorBoard(await api("DELETE", `/api/jobs/${current.id}/tensorboard`));
  }));
  loadTemplates();
  loadJobs();
  pollTimer = setInterval(pollStatus, 1000);
}

document.addEventListener("DOMContentLoaded", init);
