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
  showJob(job);
  await loadFormData(job);
  renderForm();
  clearErrors();
  loadHistory();
  openConsole(true);
  loadSamples();
  loadTrained();
  loadTensorBoard();
  loadChart();
  $("events-msg").textContent = "";
  await loadJobs();
}

function showJob(job) {
  $("job-name").textContent = job.name;
  const st = $("job-status");
  st.textContent = job.status; st.className = "status " + job.status;
  $("job-kind").textContent = `${job.family} · ${job.mode === "lora" ? "LoRA" : "Full Finetune"} · ${job.script}`;
  $("command").textContent = job.command;
  $("job-folder").textContent = job.folder;
  const active = job.status === "running" || job.status === "queued";
  $("start-btn").disabled = active;
  $("start-btn").textContent = job.status === "stopped" || job.status === "failed" ? "Resume" : "Start";
  $("stop-btn").disabled = !active;
  $("save-btn").disabled = active;
  $("delete-btn").disabled = active;
}

async function pollStatus() {
  if (!current) return;
  try {
    const s = await api("GET", `/api/jobs/${current.id}/status`);
    const changed = s.status !== current.status;
    current.status = s.status;
    showJob(current);
    const p = s.progress;
    if (p) {
      const parts = [`step ${p.step} / ${p.total} (${p.percent}%)`, `elapsed ${p.elapsed}`, `ETA ${p.eta}`];
      if (p.loss !== undefined) parts.push(`loss ${p.loss}`);
      if (p.lr !== undefined) parts.push(`LR ${p.lr}`);
      if (p.rate) parts.push(p.rate);
      $("progress").textContent = parts.join(" · ");
      if ((s.status === "running" && chartTick++ % 5 === 0) || changed) { loadChart(); loadSamples(); }
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

async function loadSamples() {
  if (!current) return;
  const list = await api("GET", `/api/jobs/${current.id}/samples`);
  const box = $("samples");
  box.textContent = "";
  $("no-samples").hidden = list.length > 0;
  for (const s of list) {
    const url = `/api/jobs/${current.id}/files/${s.path.split("/").map(encodeURIComponent).join("/")}`;
    const img = el("img", { src: url, alt: s.name, title: s.name });
    img.addEventListener("click", () => window.open(url, "_blank"));
    box.appendChild(img);
  }
}

async function loadTrained() {
  if (!current) return;
  $("maint-folder").textContent = current.folder;
  const list = await api("GET", `/api/jobs/${current.id}/trained`);
  const ul = $("trained");
  ul.textContent = "";
  $("no-trained").hidden = list.length > 0;
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
}
async function loadTensorBoard() {
  if (current) showTensorBoard(await api("GET", `/api/jobs/${current.id}/tensorboard`));
}

async function loadChart() {
  if (!current) return;
  const points = await api("GET", `/api/jobs/${current.id}/history`);
  const svg = $("chart");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const shown = points.length >= 2;
  svg.style.display = shown ? "" : "none";
  $("chart-legend").style.display = shown ? "" : "none";
  if (!shown) return;
  const ns = "http://www.w3.org/2000/svg";
  const maxStep = points[points.length - 1].step, minStep = points[0].step;
  const line = (key, cls) => {
    const vals = points.filter((p) => typeof p[key] === "number");
    if (vals.length < 2) return;
    const lo = Math.min(...vals.map((p) => p[key])), hi = Math.max(...vals.map((p) => p[key]));
    const pts = vals.map((p) => {
      const x = ((p.step - minStep) / Math.max(1, maxStep - minStep)) * 600;
      const y = 115 - ((p[key] - lo) / (hi - lo || 1)) * 110;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    const pl = document.createElementNS(ns, "polyline");
    pl.setAttribute("points", pts.join(" "));
    pl.setAttribute("class", cls);
    svg.appendChild(pl);
  };
  line("loss", "loss");
  line("lr", "lr");
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
    current = r.job; showJob(current); openConsole(true); loadJobs();
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
    showJob(current); renderForm(); clearErrors(); loadHistory();
  }));
  $("delete-events-btn").addEventListener("click", () => action(async () => {
    if (!confirm("Delete this job's TensorBoard event files?")) return;
    const r = await api("DELETE", `/api/jobs/${current.id}/tensorboard_events?confirm=yes`);
    $("events-msg").textContent = `${r.deleted} event file(s) deleted`;
  }));
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
