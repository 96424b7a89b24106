// The job's settings form, drawn from the trainer's own description of the job's script and family
// (GET /api/describe/FAMILY/MODE: every flag's type, default, choices, help and range; the family's labels and
// component-file flags). This file keeps only the layout: which flags each section shows and a few labels.
// The custom widgets (dataset folders, GPUs, multi-GPU) are in widgets.js. User text is only ever set with
// textContent / value.
"use strict";

// A section is [title, config.toml section for new keys, fields] or [title, "custom widget", mode]. A field is a
// flag name, shown when the job's script has that flag ("flag|Label" overrides the label), "@components" (the
// family's component-file flags) or "dataset:key" (a dataset.toml key of DATASET_FIELDS).
const LAYOUT = [
  ["Model and mode", "model", ["pretrained_model_name_or_path|Model path", "@components", "vae|VAE", "system_prompt",
    "mixed_precision"]],
  ["Optimization", "optimizer", ["optimizer_type|Optimizer", "optimizer_args", "learning_rate", "unet_lr|UNet / transformer LR",
    "text_encoder_lr|Text encoder LR", "lr_scheduler|Scheduler", "lr_scheduler_num_cycles|Restarts count",
    "lr_scheduler_min_lr_ratio|Minimum LR (fraction of initial)", "lr_warmup_steps|Warm-up steps",
    "decoupled_weight_decay|Decoupled weight decay", "max_grad_norm|Gradient clipping"]],
  ["Training Schedule", "training", ["max_train_steps|Max steps", "max_train_epochs|Epochs", "gradient_accumulation_steps",
    "save_every_n_steps", "save_every_n_epochs", "save_last_n_steps", "seed", "output_name"]],
  ["Caching", "caching", ["cache_latents", "cache_latents_to_disk", "vae_batch_size|VAE batch size", "cache_text_encoder_outputs"]],
  ["Performance", "performance"],
  ["Dataset Folders", "folders"],
  ["Global Dataset Settings", "dataset", ["dataset:caption_extension", "dataset:resolution", "dataset:batch_size",
    "dataset:resolution_schedule", "dataset:resolution_step_fractions", "shuffle_caption", "flip_aug", "alpha_mask"]],
  ["Bucketing", "dataset", ["dataset:enable_bucket", "dataset:min_bucket_reso", "dataset:max_bucket_reso",
    "dataset:bucket_reso_steps", "dataset:bucket_no_upscale", "keep_bucket_order|Keep order within buckets"]],
  ["LoRA Configuration", "network", ["network_module", "network_dim|Dim (rank)", "network_alpha|Alpha", "network_dropout|Dropout",
    "network_args", "network_train_unet_only|Freeze text encoders", "network_weights|Initialise from LoRA",
    "cond_emb_dim|Conditioning embedding dim (LLLite)"]],
  ["Full Finetune Options", "finetune", "finetune"],
  ["Textual Inversion", "textual_inversion", ["token_string|Token", "init_word|Initial word(s)",
    "num_vectors_per_token|Vectors", "use_object_template", "use_style_template", "weights|Continue from embedding"]],
  ["Resume", "training", ["resume|Auto-resume", "save_state"]],
  ["Sampling", "sampling", ["sample_every_n_steps", "sample_every_n_epochs", "sample_sampler|Sampler"]],
  ["Diagnostics", "diagnostics"],
  ["Hardware Allocation", "gpus"],
  ["Multi-GPU Optimization", "multigpu"],
];
// Fields of the Full Finetune Options below the components' table (config.toml section "optimizer" for new keys).
const FINETUNE_FIELDS = ["block_lr|Per-block LRs", "save_model_as|Save as", "use_ema|EMA weights", "fused_backward_pass",
  "self_attn_lr", "cross_attn_lr", "mlp_lr", "mod_lr"];
const LABELS = { clip_l: "CLIP-L", clip_g: "CLIP-G", t5xxl: "T5-XXL", ae: "Autoencoder", gemma2: "Gemma-2", qwen3: "Qwen3",
  byt5: "byT5", text_encoder: "Text encoder", llm_adapter_path: "LLM adapter", t5_tokenizer_path: "T5 tokenizer" };
const WIDGETS = { resume: "resume" };  // flags drawn by a widget of their own instead of by their type
// dataset.toml keys (not trainer flags): [label, type, help, path in dataset.toml]
const DATASET_FIELDS = {
  caption_extension: ["Caption extension", "text", "default for every folder: .txt or .caption", "general"],
  resolution: ["Resolution(s)", "resolution", "one size (512) or several, comma-separated (512,768,1024)", "datasets.0"],
  batch_size: ["Batch size (per resolution)", "intlist", "one number, or one per resolution, comma-separated (4,2,1)", "datasets.0"],
  resolution_schedule: ["Resolution schedule", "select", "progressive: train low to high resolution (needs 2 or more resolutions)", "datasets.0", ["all", "progressive"]],
  resolution_step_fractions: ["Step fractions", "floatlist", "progressive: fraction of the steps per resolution, comma-separated, summing to 1.0", "datasets.0"],
  enable_bucket: ["Aspect-ratio buckets", "bool", "images keep their aspect ratio, batched by bucket", "datasets.0"],
  min_bucket_reso: ["Smallest bucket side", "int", "pixels (default 256)", "datasets.0"],
  max_bucket_reso: ["Largest bucket side", "int", "pixels (default 1024)", "datasets.0"],
  bucket_reso_steps: ["Bucket step", "int", "bucket sides are multiples of this (64 for SD 1.x / 2.x)", "datasets.0"],
  bucket_no_upscale: ["No upscale", "bool", "never enlarge an image to fill a bucket", "datasets.0"],
};

let description = null;  // the job's script and family, as the trainer describes them
let flagsByName = {};
let perfOptions = [];    // the server's availability of the Performance options for the selected job
let gpuList = [];        // the GPUs the server found
const descriptions = {}; // "family/mode" -> description (the trainer's flags do not change while the page is open)

// A field: {file, key, label, type, help, where, choices, placeholder}; null when the job's script has no such flag.
function fieldFor(entry, where) {
  const [name, label] = entry.split("|");
  if (name.startsWith("dataset:")) {
    const key = name.slice(8);
    const [dlabel, type, help, path, choices] = DATASET_FIELDS[key];
    return { file: "dataset", key, label: dlabel, type, help, where: path, choices };
  }
  const flag = flagsByName[name];
  if (!flag) return null;
  const type = WIDGETS[name] || (flag.type === "bool" || !flag.takes_value ? "bool" : flag.many ? "list"
    : flag.choices ? "select" : flag.type === "int" || flag.type === "float" ? flag.type : "text");
  const help = [flag.help, flag.range && flag.range.text].filter(Boolean).join("; ");
  const dflt = flag.default === null || flag.default === undefined || flag.default === "" ? null
    : Array.isArray(flag.default) ? flag.default.join(type === "list" ? " " : ",") : String(flag.default);
  return { file: "config", key: name, label: label || LABELS[name] || humanize(name), type, help, where, choices: flag.choices,
    placeholder: dflt === null ? "" : `default: ${dflt}` };
}
function humanize(name) { const s = name.replace(/_/g, " "); return s.charAt(0).toUpperCase() + s.slice(1); }
function sectionFields(entries, where) {
  const out = [];
  for (const e of entries) {
    const names = e === "@components" ? description.family.component_file_flags : [e];
    for (const n of names) { const f = fieldFor(n, where); if (f && !out.some((o) => o.key === f.key)) out.push(f); }
  }
  return out;
}

// --- values in the settings ---------------------------------------------------------------------------------
function findSection(config, key) {
  if (Object.prototype.hasOwnProperty.call(config, key) && typeof config[key] !== "object") return "";
  for (const [section, values] of Object.entries(config)) {
    if (values && typeof values === "object" && !Array.isArray(values) && Object.prototype.hasOwnProperty.call(values, key)) return section;
  }
  return null;
}
function datasetNode(dataset, path, create) {
  let node = dataset;
  const parts = path.split(".");
  for (let i = 0; i < parts.length; i++) {
    const idx = /^\d+$/.test(parts[i]) ? Number(parts[i]) : parts[i];
    if (node[idx] === undefined) {
      if (!create) return null;
      node[idx] = i + 1 < parts.length && /^\d+$/.test(parts[i + 1]) ? [] : {};
    }
    node = node[idx];
  }
  return node;
}
function configValue(key) {
  const s = findSection(settings.config, key);
  if (s === null) return undefined;
  return s === "" ? settings.config[key] : settings.config[s][key];
}
function setConfig(key, value, where) {
  let s = findSection(settings.config, key);
  if (s === null) { if (value === undefined) return; s = where; settings.config[s] = settings.config[s] || {}; }
  const target = s === "" ? settings.config : settings.config[s];
  if (value === undefined) delete target[key]; else target[key] = value;
}
function getValue(f) {
  if (f.file === "config") return configValue(f.key);
  const node = datasetNode(settings.dataset, f.where, false);
  return node ? node[f.key] : undefined;
}
function setValue(f, value) {
  if (f.file === "config") { setConfig(f.key, value, f.where); return; }
  const node = datasetNode(settings.dataset, f.where, value !== undefined);
  if (!node) return;
  if (value === undefined) delete node[f.key]; else node[f.key] = value;
}

// --- rendering ------------------------------------------------------------------------------------------------
let formFields = [];  // the fields drawn from the layout (read back by readForm)
function renderForm() {
  const box = $("sections");
  box.textContent = "";
  settings.launch = settings.launch || {};
  formFields = [];
  for (const [title, where, entries] of LAYOUT) {
    if (typeof entries === "string" && entries !== current.mode) continue;
    const fs = el("fieldset", { "data-section": title });
    fs.appendChild(el("legend", {}, title));
    if (!Array.isArray(entries)) {
      RENDERERS[where](fs);
    } else {
      const fields = sectionFields(entries, where);
      if (!fields.length) continue;
      fs.appendChild(fieldGrid(fields));
    }
    box.appendChild(fs);
  }
  renderPrompts();
  updateDependencies();
  afterRender();  // app.js: the tabs and the check's marks
}
function fieldGrid(fields) {
  const grid = el("div", { class: "fields" });
  for (const f of fields) { grid.appendChild(renderField(f)); formFields.push(f); }
  return grid;
}

function inputFor(f, value) {
  const id = "f-" + f.key;
  let input;
  if (f.type === "bool" || f.type === "resume") {
    input = el("input", { type: "checkbox", id });
    input.checked = f.type === "resume" ? value === "auto" : Boolean(value);
    const lab = el("label", { for: id });
    lab.appendChild(input); lab.appendChild(document.createTextNode(f.label));
    return [input, lab];
  }
  if (f.type === "select") {
    input = el("select", { id });
    const options = ["", ...f.choices.map(String)];
    if (value !== undefined && !options.includes(String(value))) options.push(String(value));
    for (const o of options) input.appendChild(el("option", { value: o }, o || (f.placeholder ? `(${f.placeholder})` : "(default)")));
    input.value = value === undefined ? "" : String(value);
  } else {
    input = el("input", { id, type: "text", placeholder: f.placeholder || "" });
    if (f.type === "int" || f.type === "float") input.inputMode = "decimal";
    if (value === undefined) input.value = "";
    else if (Array.isArray(value)) input.value = f.type === "list" ? value.join(" ") : value.join(",");
    else input.value = String(value);
  }
  return [input, el("label", { for: id }, f.label)];
}

function renderField(f, value) {
  const wrap = el("div", { class: "field", "data-field": f.key, title: f.help || "" });
  if (value === undefined && f.file !== "launch") value = getValue(f);
  const [input, label] = inputFor(f, value);
  if (f.type === "bool" || f.type === "resume") { wrap.classList.add("checkbox"); wrap.appendChild(label); }
  else { wrap.appendChild(label); wrap.appendChild(input); }
  input.name = f.key;
  input.dataset.key = f.key;
  if (f.help) wrap.appendChild(el("div", { class: "muted help" }, f.help));
  if (f.type === "resume") {  // a state folder, blank (and off) while auto-resume is on
    const path = el("input", { type: "text", id: "f-resume_path", placeholder: "state folder (output/NAME-state)" });
    path.value = value && value !== "auto" ? String(value) : "";
    path.disabled = input.checked;
    input.addEventListener("change", () => { path.disabled = input.checked; if (input.checked) path.value = ""; });
    wrap.appendChild(path);
  }
  return wrap;
}

function parseValue(type, input) {
  if (type === "bool") return input.checked && !input.disabled ? true : undefined;
  const raw = input.value.trim();
  if (raw === "") return undefined;
  if (type === "int" && /^-?\d+$/.test(raw)) return parseInt(raw, 10);
  if (type === "float" && !isNaN(Number(raw))) return Number(raw);
  if (type === "list") return raw.split(/\s+/);
  if (type === "floatlist" || type === "intlist" || type === "resolution") {
    const parts = raw.split(",").map((x) => x.trim()).filter(Boolean);
    if (!parts.every((x) => (type === "resolution" ? /^\d+$/.test(x) : !isNaN(Number(x))))) return raw;
    return type !== "floatlist" && parts.length === 1 ? Number(parts[0]) : parts.map(Number);
  }
  return raw;  // the trainer's parser says what is wrong with a non-number
}

// --- Performance: the server says what this machine, the family and the trainer can use --------------------
function renderOptions(fs, group) {
  const grid = el("div", { class: "fields" });
  const workers = group === "performance" && fieldFor("max_data_loader_n_workers|Data-loader workers", "dataset");
  if (workers) { grid.appendChild(renderField(workers)); formFields.push(workers); }
  for (const o of perfOptions.filter((p) => p.group === group)) {
    const f = { file: "config", key: o.kind === "memory" ? "memory" : o.key, label: o.label, help: o.help, where: o.section,
      type: o.kind === "memory" || o.kind.startsWith("choice:") ? "select" : o.kind,
      choices: o.kind === "memory" ? ["highvram", "lowram"] : o.kind.startsWith("choice:") ? o.kind.slice(7).split("|") : null };
    const value = o.kind !== "memory" ? undefined : configValue("highvram") ? "highvram" : configValue("lowram") ? "lowram" : "";
    const wrap = renderField(f, value);
    if (o.kind === "memory") for (const opt of wrap.querySelector("select").options) opt.textContent = { "": "(default)", highvram: "VRAM (--highvram)", lowram: "RAM (--lowram)" }[opt.value];
    wrap.classList.add("perf");
    wrap.dataset.perf = o.key;
    const reason = el("p", { class: "reason" }, o.available ? "" : o.reason);
    reason.hidden = o.available;
    wrap.appendChild(reason);
    if (!o.available) wrap.querySelector("input, select").disabled = true;
    grid.appendChild(wrap);
  }
  fs.appendChild(grid);
  fs.addEventListener("change", updateDependencies);
}
function needsOn(key) {
  const input = document.querySelector(`#sections [data-key="${key}"]`);
  if (!input) return Boolean(configValue(key));
  if (input.type === "checkbox") return input.checked && !input.disabled;
  if (key === "max_data_loader_n_workers") return input.value.trim() === "" || Number(input.value) > 0;
  return Boolean(input.value.trim());
}
function updateDependencies() {
  for (const o of perfOptions) {
    if (!o.available || !o.needs) continue;
    const wrap = document.querySelector(`#sections .field[data-perf="${o.key}"]`);
    if (!wrap) continue;
    const ok = needsOn(o.needs);
    wrap.querySelector("input, select").disabled = !ok;
    const reason = wrap.querySelector(".reason");
    reason.textContent = ok ? "" : o.needs_reason;
    reason.hidden = ok;
  }
}
function readPerformance() {
  for (const o of perfOptions) {
    const input = document.querySelector(`#sections [data-key="${o.kind === "memory" ? "memory" : o.key}"]`);
    if (!input) continue;
    if (o.kind === "memory") {
      setConfig("highvram", input.value === "highvram" && !input.disabled ? true : undefined, o.section);
      setConfig("lowram", input.value === "lowram" && !input.disabled ? true : undefined, o.section);
    } else if (o.kind.startsWith("choice:")) {
      setConfig(o.key, input.disabled ? undefined : parseValue("text", input), o.section);
    } else if (o.kind === "int") {
      const v = input.disabled ? undefined : parseValue("int", input);
      setConfig(o.key, v === 0 ? undefined : v, o.section);  // 0 = off: no flag
    } else {
      setConfig(o.key, parseValue("bool", input), o.section);
    }
  }
}

// --- Full Finetune Options: what trains, per component (the family's labels) ---------------------------------
function renderFinetune(fs) {
  const facts = description.family;
  const table = el("table", { class: "components" });
  const head = el("tr");
  for (const h of ["Component", "Train", "Learning rate"]) head.appendChild(el("th", {}, h));
  table.appendChild(head);
  const unet = el("tr", { "data-field": "learning_rate" });
  unet.appendChild(el("td", {}, facts.denoiser_label || "Denoiser"));
  const unetTrain = el("input", { type: "checkbox", id: "f-train_unet" });
  unetTrain.checked = configValue("learning_rate") !== 0;
  const td = el("td"); td.appendChild(unetTrain); unet.appendChild(td);
  unet.appendChild(el("td", { class: "muted" }, "the Optimization learning rate (off: --learning_rate 0, frozen)"));
  table.appendChild(unet);
  if (flagsByName.llm_adapter_lr) table.appendChild(adapterRow());
  const names = facts.text_encoder_labels || [];
  const te = el("tr", { "data-field": "train_text_encoder", class: "field" });
  te.appendChild(el("td", {}, names.length === 1 ? names[0] : "Text encoders"));
  const teTrain = el("input", { type: "checkbox", id: "f-train_text_encoder", "data-key": "train_text_encoder" });
  teTrain.checked = Boolean(configValue("train_text_encoder"));
  const td2 = el("td"); td2.appendChild(teTrain); te.appendChild(td2);
  const teLr = el("td"); teLr.appendChild(lrInput("learning_rate_te", "every text encoder (--learning_rate_te); blank: the base LR"));
  te.appendChild(teLr);
  table.appendChild(te);
  names.forEach((name, i) => {
    const key = `learning_rate_te${i + 1}`;
    if (names.length < 2 || !flagsByName[key]) return;  // one encoder: --learning_rate_te is its rate
    const row = el("tr", { "data-field": key, class: "field" });
    row.appendChild(el("td", {}, name));
    row.appendChild(el("td", { class: "muted" }, "0 freezes it"));
    const c = el("td"); c.appendChild(lrInput(key, `--${key}: this encoder only`)); row.appendChild(c);
    table.appendChild(row);
  });
  fs.appendChild(table);
  fs.appendChild(el("p", { class: "muted help" }, "As the fine-tune scripts: the denoiser trains unless --learning_rate is 0; with --train_text_encoder each encoder trains at its own rate, else --learning_rate_te, else the base rate; a rate of 0 keeps that encoder frozen."));
  fs.appendChild(fieldGrid(sectionFields(FINETUNE_FIELDS, "optimizer")));
  const sync = () => { for (const i of table.querySelectorAll("tr[data-field^=learning_rate_te] input, tr[data-field=train_text_encoder] input[type=text]")) i.disabled = !teTrain.checked; };
  teTrain.addEventListener("change", sync);
  sync();
}
// A trained adapter between the text encoder and the denoiser (--llm_adapter_lr); "frozen" is its rate 0.
function adapterRow() {
  const row = el("tr", { "data-field": "llm_adapter_lr", class: "field" });
  row.appendChild(el("td", {}, "LLM adapter"));
  const frozen = el("input", { type: "checkbox", id: "f-llm_adapter_frozen" });
  frozen.checked = configValue("llm_adapter_lr") === 0;
  row.appendChild(el("td", { class: "muted" }, "unless frozen"));
  const lr = lrInput("llm_adapter_lr", "--llm_adapter_lr: the adapter's rate; blank: the base LR");
  const c = el("td");
  const lab = el("label", { for: "f-llm_adapter_frozen" });
  lab.appendChild(frozen);
  lab.appendChild(document.createTextNode(" Keep the LLM adapter weights frozen during training (--llm_adapter_lr 0); else its rate:"));
  c.appendChild(lab); c.appendChild(lr); row.appendChild(c);
  const sync = () => { lr.disabled = frozen.checked; if (frozen.checked) lr.value = ""; };
  frozen.addEventListener("change", sync);
  sync();
  return row;
}
function lrInput(key, help) {
  const input = el("input", { type: "text", id: "f-" + key, "data-key": key, placeholder: "blank", title: help });
  const v = configValue(key);
  input.value = v === undefined ? "" : String(v);
  return input;
}
function readFinetune() {
  const unet = $("f-train_unet");
  if (!unet) return;
  setConfig("train_text_encoder", $("f-train_text_encoder").checked ? true : undefined, "training");
  for (const key of ["learning_rate_te", "learning_rate_te1", "learning_rate_te2"]) {
    const input = $("f-" + key);
    setConfig(key, input && !input.disabled ? parseValue("float", input) : undefined, "optimizer");
  }
  const frozen = $("f-llm_adapter_frozen");
  if (frozen) setConfig("llm_adapter_lr", frozen.checked ? 0 : parseValue("float", $("f-llm_adapter_lr")), "optimizer");
  if (!unet.checked) setConfig("learning_rate", 0, "optimizer");
  else if (configValue("learning_rate") === 0) setConfig("learning_rate", undefined, "optimizer");
}

const RENDERERS = { performance: (fs) => renderOptions(fs, "performance"), diagnostics: (fs) => renderOptions(fs, "diagnostics"),
  folders: renderFolders, finetune: renderFinetune, gpus: renderGpus, multigpu: renderMultiGpu };

// --- reading the form, saving, errors ---------------------------------------------------------------------------
function readForm() {
  for (const f of formFields) {
    const input = document.querySelector(`#sections [data-key="${f.key}"]`);
    if (!input) continue;
    if (f.type === "resume") setValue(f, input.checked ? "auto" : ($("f-resume_path").value.trim() || undefined));
    else setValue(f, parseValue(f.type === "select" ? "text" : f.type, input));
  }
  readPerformance();
  readFolders();
  readFinetune();
  readLaunch();
  settings.prompts = Array.from(document.querySelectorAll("#prompt-list input")).map((i) => i.value).filter((s) => s.trim());
}

function clearErrors() {
  for (const e of document.querySelectorAll(".invalid")) e.classList.remove("invalid");
  for (const e of document.querySelectorAll("#sections .error")) e.remove();
  $("form-error").hidden = true; $("form-ok").hidden = true;
}
// The field an error names: in the folder row of a dataset.toml subset ("datasets[0].subsets[1]"), else anywhere.
function errorTarget(field, where) {
  if (!field) return null;
  const m = where ? /^datasets\[0\]\.subsets\[(\d+)\]$/.exec(where) : null;
  if (m) {
    const row = document.querySelector(`#folder-rows .folder-row[data-index="${m[1]}"]`);
    const t = row && row.querySelector(`.field[data-field="${field}"]`);
    if (t) return t;
  }
  // any other table (general, datasets[0]) or config.toml: the field outside the folder rows first
  return document.querySelector(`#sections [data-field="${field}"]:not(.folder-row *)`)
    || document.querySelector(`#sections [data-field="${field}"]`);
}
function showError(message, field, where) {
  const wrap = errorTarget(field, where);
  if (wrap) {
    wrap.classList.add("invalid");
    const p = el("p", { class: "error" }, message);
    if (wrap.tagName === "TR") { const td = wrap.lastChild; td.appendChild(p); } else wrap.appendChild(p);
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
  setBusy(true, "Saving: running every check Start makes...");
  try {
    settings = await api("PUT", `/api/jobs/${current.id}/settings`, settings);
    renderForm();
    $("form-ok").textContent = "Saved: every check Start makes passed.";
    $("form-ok").hidden = false;
    loadHistory();
    current = await api("GET", `/api/jobs/${current.id}`);
    onSettingsSaved();
    return true;
  } catch (e) {
    const d = e.detail && typeof e.detail === "object" ? e.detail : { error: e.message, field: null };
    onSettingsError(d.field);
    showError(d.error, d.field, d.where);
    return false;
  } finally {
    setBusy(false);
  }
}

async function loadFormData(job) {
  const which = `${job.family}/${job.mode}`;
  let hw;
  [perfOptions, settings, hw, descriptions[which]] = await Promise.all([api("GET", `/api/jobs/${job.id}/performance`),
    api("GET", `/api/jobs/${job.id}/settings`), api("GET", "/api/hardware"),
    descriptions[which] || api("GET", `/api/describe/${which}`)]);
  gpuList = hw.gpus;
  description = descriptions[which];
  flagsByName = Object.fromEntries(description.flags.map((f) => [f.name, f]));
}
