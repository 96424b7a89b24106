// The training-job page: plain DOM, no build step. User text is only ever set with textContent / value.
"use strict";

// The form: [section title, [[file, key, label, type, help, where (default section or dataset path), families]]].
// file "config" keys live in any [section] of config.toml (the trainer flattens them); file "dataset"
// keys sit at a path of dataset.toml.
const SECTIONS = [
  ["Model and mode", [
    ["config", "pretrained_model_name_or_path", "Model path", "text", "a .safetensors / .ckpt file, a diffusers folder or a Hub id; tiny:sd1 is the built-in test model", "model"],
    ["config", "clip_l", "CLIP-L", "text", "FLUX.1: the CLIP-L text encoder file", "model", ["flux"]],
    ["config", "t5xxl", "T5-XXL", "text", "FLUX.1: the T5-XXL text encoder file", "model", ["flux"]],
    ["config", "ae", "Autoencoder", "text", "FLUX.1: the autoencoder file", "model", ["flux"]],
    ["config", "mixed_precision", "Mixed precision", "select:|no|fp16|bf16", "no on CPU; bf16 on recent GPUs", "training"],
  ]],
  ["Optimization", [
    ["config", "optimizer_type", "Optimizer", "text", "AdamW, AdamW8bit, Prodigy, Lion, Adafactor, ...", "optimizer"],
    ["config", "optimizer_args", "Optimizer args", "list", "key=value, space-separated (e.g. weight_decay=0.01 betas=0.9,0.99)", "optimizer"],
    ["config", "learning_rate", "Learning rate", "float", "base learning rate", "optimizer"],
    ["config", "unet_lr", "UNet / transformer LR", "float", "blank: the base learning rate", "optimizer"],
    ["config", "lr_scheduler", "Scheduler", "select:|constant|constant_with_warmup|linear|cosine|cosine_with_restarts|polynomial|cosine_with_min_lr|warmup_stable_decay", "learning-rate schedule", "optimizer"],
    ["config", "lr_scheduler_num_cycles", "Restarts count", "int", "cosine_with_restarts: number of cycles", "optimizer"],
    ["config", "lr_scheduler_min_lr_ratio", "Minimum LR (fraction of initial)", "float", "e.g. 0.1: the schedule never goes below 10% of the initial LR", "optimizer"],
    ["config", "lr_warmup_steps", "Warm-up steps", "text", "steps, or a percentage of the run such as 5%", "optimizer"],
    ["config", "max_grad_norm", "Gradient clipping", "float", "max gradient norm; 0 turns clipping off", "optimizer"],
  ]],
  ["Training Schedule", [
    ["config", "max_train_steps", "Max steps", "int", "train this many optimizer steps", "training"],
    ["config", "max_train_epochs", "Epochs", "int", "overrides max steps when given", "training"],
    ["config", "save_every_n_steps", "Save every N steps", "int", "", "training"],
    ["config", "save_every_n_epochs", "Save every N epochs", "int", "", "training"],
    ["config", "save_last_n_steps", "Keep saves of last N steps", "int", "older step saves are removed", "training"],
    ["config", "seed", "Seed", "int", "blank: a random seed, recorded in the outputs", "training"],
    ["config", "output_name", "Output name", "text", "file name of the trained model (in the job's output/ folder)", "output"],
  ]],
  ["Performance and caching", [
    ["config", "gradient_checkpointing", "Gradient checkpointing", "bool", "less memory, about 20% slower", "training"],
    ["config", "max_data_loader_n_workers", "Data-loader workers", "int", "0 loads images in the training process", "dataset"],
    ["config", "persistent_data_loader_workers", "Persistent data-loader workers", "bool", "keep workers between epochs", "dataset"],
    ["config", "cache_latents", "Cache latents", "bool", "encode every image once before training", "caching"],
    ["config", "cache_latents_to_disk", "Cache latents to disk", "bool", "keep the latent cache between runs", "caching"],
    ["config", "cache_text_encoder_outputs", "Cache text-encoder outputs", "bool", "SDXL / FLUX.1: trains the UNet / transformer only", "caching", ["sdxl", "flux"]],
  ]],
  ["Dataset", [
    ["dataset", "image_dir", "Image folder", "text", "folder of images and captions (relative paths are from the toolkit's folder)", "datasets.0.subsets.0"],
    ["dataset", "num_repeats", "Repeats", "int", "each image counts this many times per epoch", "datasets.0.subsets.0"],
    ["dataset", "class_tokens", "Class tokens", "text", "caption for images without a caption file", "datasets.0.subsets.0"],
    ["dataset", "is_reg", "Regularisation images", "bool", "this folder holds regularisation images", "datasets.0.subsets.0"],
    ["dataset", "caption_extension", "Caption extension", "text", ".txt or .caption", "general"],
    ["dataset", "resolution", "Resolution(s)", "resolution", "one size (512) or several, comma-separated (512,768,1024)", "datasets.0"],
    ["dataset", "batch_size", "Batch size", "int", "", "datasets.0"],
    ["dataset", "enable_bucket", "Aspect-ratio buckets", "bool", "", "datasets.0"],
    ["dataset", "bucket_no_upscale", "Bucket: no upscale", "bool", "never enlarge images", "datasets.0"],
    ["dataset", "resolution_schedule", "Resolution schedule", "select:|all|progressive", "progressive: train low to high resolution (needs 2 or more resolutions)", "datasets.0"],
    ["dataset", "resolution_step_fractions", "Step fractions", "floatlist", "progressive: fraction of the steps per resolution, comma-separated, summing to 1.0", "datasets.0"],
    ["config", "alpha_mask", "Alpha channel as loss mask", "bool", "transparent pixels do not count in the loss", "dataset"],
  ]],
  ["LoRA Configuration", [
    ["config", "network_module", "Network module", "select:networks.lora|networks.lora_flux|lycoris.kohya", "LoRA, or LyCORIS kinds through lycoris.kohya and network args (algo=loha ...)", "network", null, "lora"],
    ["config", "network_dim", "Dim (rank)", "int", "", "network", null, "lora"],
    ["config", "network_alpha", "Alpha", "float", "scale = alpha / dim", "network", null, "lora"],
    ["config", "network_dropout", "Dropout", "float", "neuron dropout, 0 to 1", "network", null, "lora"],
    ["config", "network_args", "Network args", "list", "key=value, space-separated", "network", null, "lora"],
    ["config", "network_train_unet_only", "Freeze text encoders", "bool", "train the UNet / transformer only", "network", null, "lora"],
    ["config", "network_weights", "Initialise from LoRA", "text", "an existing LoRA file to start from", "network", null, "lora"],
  ]],
  ["Full Finetune Options", [
    ["config", "train_text_encoder", "Train the text encoder(s)", "bool", "off: the UNet / transformer only", "training", null, "finetune"],
    ["config", "learning_rate_te1", "Text encoder 1 LR", "float", "blank: the base learning rate", "optimizer", null, "finetune"],
    ["config", "learning_rate_te2", "Text encoder 2 LR", "float", "SDXL: the second text encoder", "optimizer", ["sdxl"], "finetune"],
    ["config", "block_lr", "Per-block LRs", "text", "comma-separated, one per block of the family's layout; 0 freezes a block", "optimizer", null, "finetune"],
    ["config", "save_model_as", "Save as", "select:safetensors|ckpt|diffusers|diffusers_safetensors", "", "output", null, "finetune"],
    ["config", "use_ema", "EMA weights", "bool", "keep an exponential moving average of the weights", "training", null, "finetune"],
    ["config", "fused_backward_pass", "Fused backward pass", "bool", "Adafactor: less memory", "optimizer", null, "finetune"],
  ]],
  ["Resume and sampling", [
    ["config", "resume", "Auto-resume", "resume", "continue from the newest saved state in the job's output folder (Stop saves one)", "training"],
    ["config", "sample_every_n_steps", "Sample every N steps", "int", "needs at least one prompt below", "sampling"],
    ["config", "sample_every_n_epochs", "Sample every N epochs", "int", "", "sampling"],
    ["config", "sample_sampler", "Sampler", "select:|ddim|euler|euler_a|dpmsolver++|k_dpm_2|lms|pndm|flow_euler", "", "sampling"],
  ]],
];

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
  settings = await api("GET", `/api/jobs/${id}/settings`);
  renderForm();
  clearErrors();
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

async function loadHardware() {
  const hw = await api("GET", "/api/hardware");
  const ul = $("gpus");
  ul.textContent = "";
  if (!hw.gpus.length) { ul.appendChild(el("li", { class: "muted" }, hw.none)); return; }
  for (const g of hw.gpus) {
    ul.appendChild(el("li", {}, `GPU ${g.index}: ${g.name} · ${g.memory_used_mib} / ${g.memory_total_mib} MiB · ${g.utilization_percent}% busy`));
  }
}

// --- settings form ---------------------------------------------------------------------------------------
function findSection(config, key) {
  if (Object.prototype.hasOwnProperty.call(config, key) && typeof config[key] !== "object") return "";
  for (const [section, values] of Object.entries(config)) {
    if (values && typeof values === "object" && !Array.isArray(values) && Object.prototype.hasOwnProperty.call(values, key)) return section;
  }
  return null;
}
function datasetNode(dataset, path, create) {
  let node = dataset;
  for (const part of path.split(".")) {
    const idx = /^\d+$/.test(part) ? Number(part) : part;
    if (node[idx] === undefined) {
      if (!create) return null;
      const next = path.split(".")[path.split(".").indexOf(part) + 1];
      node[idx] = next !== undefined && /^\d+$/.test(next) ? [] : {};
    }
    node = node[idx];
  }
  return node;
}
function getValue(f) {
  const [file, key, , , , where] = f;
  if (file === "config") {
    const s = findSection(settings.config, key);
    if (s === null) return undefined;
    return s === "" ? settings.config[key] : settings.config[s][key];
  }
  const node = datasetNode(settings.dataset, where, false);
  return node ? node[key] : undefined;
}
function setValue(f, value) {
  const [file, key, , , , where] = f;
  if (file === "config") {
    let s = findSection(settings.config, key);
    if (s === null) { s = where; settings.config[s] = settings.config[s] || {}; }
    const target = s === "" ? settings.config : settings.config[s];
    if (value === undefined) delete target[key]; else target[key] = value;
    return;
  }
  const node = datasetNode(settings.dataset, where, value !== undefined);
  if (!node) return;
  if (value === undefined) delete node[key]; else node[key] = value;
}

function renderForm() {
  const box = $("sections");
  box.textContent = "";
  for (const [title, fields] of SECTIONS) {
    const visible = fields.filter((f) => (!f[6] || f[6].includes(current.family)) && (!f[7] || f[7] === current.mode));
    if (!visible.length) continue;
    const fs = el("fieldset");
    fs.appendChild(el("legend", {}, title));
    const grid = el("div", { class: "fields" });
    for (const f of visible) grid.appendChild(renderField(f));
    fs.appendChild(grid);
    box.appendChild(fs);
  }
  renderPrompts();
}

function renderField(f) {
  const [, key, label, type, help] = f;
  const wrap = el("div", { class: "field", "data-field": key, title: help || "" });
  const id = "f-" + key;
  const value = getValue(f);
  let input;
  if (type === "bool" || type === "resume") {
    wrap.classList.add("checkbox");
    input = el("input", { type: "checkbox", id });
    input.checked = type === "resume" ? value === "auto" : Boolean(value);
    const lab = el("label", { for: id });
    lab.appendChild(input);
    lab.appendChild(document.createTextNode(label));
    wrap.appendChild(lab);
  } else {
    wrap.appendChild(el("label", { for: id }, label));
    if (type.startsWith("select:")) {
      input = el("select", { id });
      const options = type.slice(7).split("|");
      if (value !== undefined && !options.includes(String(value))) options.push(String(value));
      for (const o of options) input.appendChild(el("option", { value: o }, o || "(default)"));
      input.value = value === undefined ? "" : String(value);
    } else {
      input = el("input", { id, type: "text", placeholder: help ? "" : "" });
      if (type === "int" || type === "float") input.inputMode = "decimal";
      if (value === undefined) input.value = "";
      else if (Array.isArray(value)) input.value = type === "list" ? value.join(" ") : value.join(",");
      else input.value = String(value);
    }
    wrap.appendChild(input);
  }
  input.name = key;
  input.dataset.key = key;
  if (help) wrap.appendChild(el("div", { class: "muted help" }, help));
  if (key === "image_dir") addFolderPicker(wrap, input);
  return wrap;
}

// --- folder picker (server side, inside the allowed roots) -----------------------------------------------
function addFolderPicker(wrap, input) {
  const browse = el("button", { type: "button", id: "browse-btn" }, "Browse...");
  const info = el("div", { class: "muted", id: "folder-info" });
  const strip = el("div", { class: "thumbs", id: "thumbs" });
  const picker = el("div", { class: "picker", id: "picker" });
  picker.hidden = true;
  wrap.appendChild(browse); wrap.appendChild(info); wrap.appendChild(strip); wrap.appendChild(picker);
  browse.addEventListener("click", () => action(() => openFolder(input.value.trim() || "", picker, input, true)));
  input.addEventListener("change", () => showFolder(input.value.trim(), info, strip));
  showFolder(input.value.trim(), info, strip);
}

async function showFolder(path, info, strip) {
  strip.textContent = ""; info.textContent = "";
  if (!path) return;
  try {
    const f = await api("GET", `/api/folders?path=${encodeURIComponent(path)}`);
    info.textContent = `${f.images} image(s)`;
    for (const t of f.thumbnails) strip.appendChild(el("img", { src: `/api/image?path=${encodeURIComponent(t)}`, alt: "" }));
  } catch (e) { info.textContent = e.message; }
}

async function openFolder(path, picker, input, fallback) {
  let f;
  try { f = await api("GET", `/api/folders?path=${encodeURIComponent(path)}`); }
  catch (e) { if (!fallback) throw e; f = await api("GET", "/api/folders"); }
  picker.textContent = "";
  picker.hidden = false;
  const head = el("div", { class: "picker-head" });
  head.appendChild(el("code", {}, f.path || "Allowed folders"));
  if (f.path) {
    const use = el("button", { type: "button", class: "primary" }, `Use this folder (${f.images} images)`);
    use.addEventListener("click", () => {
      input.value = f.path; picker.hidden = true;
      input.dispatchEvent(new Event("change"));
    });
    head.appendChild(use);
  }
  const close = el("button", { type: "button" }, "Close");
  close.addEventListener("click", () => { picker.hidden = true; });
  head.appendChild(close);
  picker.appendChild(head);
  const ul = el("ul");
  if (f.parent) {
    const up = el("li", { class: "folder" }, "..");
    up.addEventListener("click", () => action(() => openFolder(f.parent, picker, input)));
    ul.appendChild(up);
  } else if (f.path) {
    const top = el("li", { class: "folder" }, "(allowed folders)");
    top.addEventListener("click", () => action(() => openFolder("", picker, input)));
    ul.appendChild(top);
  }
  for (const d of f.folders) {
    const li = el("li", { class: "folder" }, `${d.name}  ·  ${d.images} image(s)`);
    li.addEventListener("click", () => action(() => openFolder(d.path, picker, input)));
    ul.appendChild(li);
  }
  picker.appendChild(ul);
}

function readForm() {
  for (const [, fields] of SECTIONS) {
    for (const f of fields) {
      const input = document.querySelector(`#sections [data-key="${f[1]}"]`);
      if (!input) continue;
      const type = f[3];
      let v;
      if (type === "bool") v = input.checked ? true : undefined;
      else if (type === "resume") v = input.checked ? "auto" : undefined;
      else {
        const raw = input.value.trim();
        if (raw === "") v = undefined;
        else if (type === "int" && /^-?\d+$/.test(raw)) v = parseInt(raw, 10);
        else if (type === "float" && raw !== "" && !isNaN(Number(raw))) v = Number(raw);
        else if (type === "list") v = raw.split(/\s+/);
        else if (type === "floatlist") {
          const parts = raw.split(",").map((x) => x.trim()).filter(Boolean);
          v = parts.every((x) => !isNaN(Number(x))) ? parts.map(Number) : raw;
        }
        else if (type === "resolution") {
          const parts = raw.split(",").map((s) => s.trim()).filter(Boolean);
          v = parts.every((p) => /^\d+$/.test(p)) ? (parts.length === 1 ? Number(parts[0]) : parts.map(Number)) : raw;
        } else v = raw;  // the trainer's parser says what is wrong with a non-number
      }
      setValue(f, v);
    }
  }
  settings.prompts = Array.from(document.querySelectorAll("#prompt-list input")).map((i) => i.value).filter((s) => s.trim());
}

function renderPrompts() {
  const ul = $("prompt-list");
  ul.textContent = "";
  for (const p of settings.prompts || []) addPromptRow(p);
  $("no-prompts").hidden = (settings.prompts || []).length > 0;
}
function addPromptRow(text) {
  const li = el("li");
  const input = el("input", { type: "text", placeholder: "a photo of sks shape --w 128 --h 128 --s 20 --l 7 --d 1" });
  input.value = text || "";
  const rm = el("button", { type: "button" }, "Remove");
  rm.addEventListener("click", () => { li.remove(); $("no-prompts").hidden = $("prompt-list").children.length > 0; });
  li.appendChild(input); li.appendChild(rm);
  $("prompt-list").appendChild(li);
  $("no-prompts").hidden = true;
}

function clearErrors() {
  for (const e of document.querySelectorAll(".field.invalid")) e.classList.remove("invalid");
  for (const e of document.querySelectorAll(".field .error")) e.remove();
  $("form-error").hidden = true; $("form-ok").hidden = true;
}
function showError(message, field) {
  const wrap = field ? document.querySelector(`#sections .field[data-field="${field}"]`) : null;
  if (wrap) {
    wrap.classList.add("invalid");
    wrap.appendChild(el("p", { class: "error" }, message));
    wrap.scrollIntoView({ block: "center" });
  } else {
    $("form-error").textContent = message;
    $("form-error").hidden = false;
  }
}

async function saveSettings(ev) {
  if (ev) ev.preventDefault();
  clearErrors();
  readForm();
  $("save-btn").disabled = true;
  $("save-btn").textContent = "Checking...";
  try {
    settings = await api("PUT", `/api/jobs/${current.id}/settings`, settings);
    renderForm();
    $("form-ok").textContent = "Saved: the trainer accepted these settings.";
    $("form-ok").hidden = false;
    return true;
  } catch (e) {
    const d = e.detail && typeof e.detail === "object" ? e.detail : { error: e.message, field: null };
    showError(d.error, d.field);
    return false;
  } finally {
    $("save-btn").textContent = "Save settings";
    showJob(current);
  }
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
    renderForm(); clearErrors();
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
  loadHardware();
  pollTimer = setInterval(pollStatus, 1000);
}

document.addEventListener("DOMContentLoaded", init);
