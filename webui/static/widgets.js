// The custom widgets of the settings form (form.js): the dataset folders with the server-side folder picker,
// the GPUs and the multi-GPU strategy (launch.toml), the sample prompts and the settings history. User text is only ever set with textContent / value.
"use strict";

const STRATEGIES = {
  single: ["Single process", "One process on one GPU (or the CPU): the run goes through accelerate launch with a config that fixes the device and the precision."],
  ddp: ["DDP (data parallel)", "Every GPU holds the whole model and trains on its own share of each batch; the gradients are averaged every step. The simplest and fastest when the model fits one GPU."],
  fsdp1: ["FSDP1 (fully sharded, v1)", "The parameters, gradients and optimizer states are sharded across the GPUs and gathered layer by layer: for models that do not fit one GPU. PyTorch's first FSDP (FlatParameter)."],
  fsdp2: ["FSDP2 (fully sharded, per-parameter)", "As FSDP1, with per-parameter sharding (DTensor): simpler state dicts, works with LoRA's mixed frozen / trained weights; no forward prefetch option."],
  deepspeed: ["DeepSpeed ZeRO", "DeepSpeed's ZeRO: stage 1 shards the optimizer states, 2 also the gradients, 3 also the parameters; can offload to CPU or NVMe."],
};
// [key, label, type, help, strategies, default]; "config:" keys are trainer flags in config.toml, the others
// go to tools/make_accelerate_config.py through launch.toml.
const STRATEGY_FIELDS = [
  ["config:ddp_gradient_as_bucket_view", "Gradients as bucket views", "bool", "--ddp_gradient_as_bucket_view: gradients live in DDP's all-reduce buckets (saves one copy of the gradients)", ["ddp"]],
  ["config:ddp_static_graph", "Static graph", "bool", "--ddp_static_graph: the set of trained parameters is the same every step (lets DDP skip the unused-parameter search)", ["ddp"]],
  ["config:ddp_backend", "Backend", "select:auto|nccl|gloo", "--ddp_backend: how the processes talk. auto: NCCL on CUDA GPUs (Linux), Gloo on CPUs and on Windows; Gloo works everywhere but is slower between GPUs", ["ddp", "fsdp1", "fsdp2"], "auto"],
  ["config:context_parallel_size", "Context parallel size", "int", "--context_parallel_size: split each sample's image and text tokens over N processes (FLUX.1, FLUX.2, Qwen-Image; the processes of a group train one batch together): for images too large for one GPU's activations", ["ddp"]],
  ["config:tensor_parallel_size", "Tensor parallel size", "int", "--tensor_parallel_size: shard the frozen denoiser's Linear layers over N processes, the LoRA following each shard (FLUX.1, FLUX.2, Qwen-Image; N processes train one batch together; a world size that is a multiple of N trains world size / N batches side by side): for a base too large for one GPU's memory", ["ddp"]],
  ["config:ddp_timeout", "Timeout (minutes)", "int", "--ddp_timeout: how long a process waits for the others in a collective operation", ["ddp"]],
  ["fsdp_cpu_offload", "CPU offload", "bool", "keep the sharded parameters in CPU memory; much less GPU memory, slower", ["fsdp1", "fsdp2"], false],
  ["fsdp_reshard_after_forward", "Reshard after forward", "bool", "free the gathered parameters after each forward (ZeRO-3-like); off keeps them for backward (faster, more memory)", ["fsdp1", "fsdp2"], true],
  ["fsdp_activation_checkpointing", "Activation checkpointing", "bool", "FSDP's own activation checkpointing of each wrapped block", ["fsdp1", "fsdp2"], false],
  ["fsdp_cpu_ram_efficient_loading", "CPU-RAM-efficient loading", "bool", "only rank 0 loads the weights, the others receive them (one copy in CPU memory)", ["fsdp1", "fsdp2"], false],
  ["fsdp_backward_prefetch", "Backward prefetch", "select:BACKWARD_PRE|BACKWARD_POST|NO_PREFETCH", "when the next layer's parameters are gathered in backward: BACKWARD_PRE overlaps most (more memory)", ["fsdp1", "fsdp2"], "BACKWARD_PRE"],
  ["fsdp_forward_prefetch", "Forward prefetch", "bool", "gather the next layer's parameters during the current forward (FSDP1 only)", ["fsdp1"], false],
  ["fsdp_use_orig_params", "Use original parameters", "bool", "keep the modules' own parameters (must stay on with LoRA: frozen and trained weights share units)", ["fsdp1", "fsdp2"], true],
  ["fsdp_limit_all_gathers", "Limit all-gathers", "bool", "rate-limit the parameter gathers so that memory does not spike", ["fsdp1", "fsdp2"], true],
  ["fsdp_wrap_policy", "Wrap policy", "select:TRANSFORMER_BASED_WRAP|SIZE_BASED_WRAP", "what one FSDP unit is: a transformer / UNet block, or a module of at least N parameters", ["fsdp1", "fsdp2"], "TRANSFORMER_BASED_WRAP"],
  ["fsdp_min_num_params", "Min parameters per unit", "int", "SIZE_BASED_WRAP: a module with at least this many parameters is one unit (default 1e8)", ["fsdp1", "fsdp2"], 100000000],
  ["zero_stage", "ZeRO stage", "select:1|2|3", "1: optimizer states sharded; 2: also gradients; 3: also parameters", ["deepspeed"], "2"],
  ["offload_optimizer_device", "Offload optimizer to", "select:none|cpu|nvme", "where the optimizer states live", ["deepspeed"], "none"],
  ["offload_param_device", "Offload parameters to", "select:none|cpu|nvme", "where the parameters live (ZeRO stage 3)", ["deepspeed"], "none"],
];

// --- Dataset Folders: the subsets of the first [[datasets]] ---------------------------------------------------
const FOLDER_FIELDS = [
  ["num_repeats", "Repeats", "int", "each image counts this many times per epoch"],
  ["class_tokens", "Class tokens", "text", "caption for images without a caption file"],
  ["caption_extension", "Caption extension", "text", "blank: the global one"],
  ["is_reg", "Regularisation", "bool", "this folder holds regularisation (class) images"],
];
function subsets() {
  const ds = datasetNode(settings.dataset, "datasets.0", true);
  ds.subsets = ds.subsets || [];
  return ds.subsets;
}
function renderFolders(fs) {
  fs.appendChild(el("p", { class: "muted" }, "Each folder is one [[datasets.subsets]] of the dataset TOML; paths must be inside the server's allowed folders."));
  const list = el("div", { id: "folder-rows" });
  fs.appendChild(list);
  for (const sub of subsets()) list.appendChild(folderRow(sub));
  renumberFolders(list);
  const add = el("button", { type: "button", id: "add-folder" }, "+ Add Folder");
  add.addEventListener("click", () => { list.appendChild(folderRow({ num_repeats: 1 })); renumberFolders(list); });
  fs.appendChild(add);
}
function renumberFolders(list) {
  const rows = list.querySelectorAll(".folder-row");
  rows.forEach((row, i) => {
    row.dataset.index = String(i);
    row.querySelector(".folder-title").textContent = `Folder ${i + 1}`;
    row.querySelector(".remove-folder").disabled = rows.length === 1;
  });
}
function folderRow(sub) {
  const row = el("div", { class: "folder-row" });
  const head = el("div", { class: "folder-head" });
  head.appendChild(el("strong", { class: "folder-title" }));
  const rm = el("button", { type: "button", class: "remove-folder" }, "Remove");
  rm.addEventListener("click", () => { const list = row.parentNode; row.remove(); renumberFolders(list); });
  head.appendChild(rm);
  row.appendChild(head);
  const grid = el("div", { class: "fields" });
  const dirWrap = el("div", { class: "field wide", "data-field": "image_dir", title: "folder of images and captions" });
  dirWrap.appendChild(el("label", {}, "Image folder"));
  const dir = el("input", { type: "text", class: "image-dir", "data-sub": "image_dir" });
  dir.value = sub.image_dir || "";
  dirWrap.appendChild(dir);
  dirWrap.appendChild(el("div", { class: "muted help" }, "relative paths are from the toolkit's folder"));
  addFolderPicker(dirWrap, dir);
  grid.appendChild(dirWrap);
  for (const [key, label, type, help] of FOLDER_FIELDS) {
    const wrap = el("div", { class: "field", "data-field": key, title: help });
    let input;
    if (type === "bool") {
      wrap.classList.add("checkbox");
      input = el("input", { type: "checkbox" });
      input.checked = Boolean(sub[key]);
      const lab = el("label");
      lab.appendChild(input); lab.appendChild(document.createTextNode(label));
      wrap.appendChild(lab);
    } else {
      wrap.appendChild(el("label", {}, label));
      input = el("input", { type: "text" });
      input.value = sub[key] === undefined ? "" : String(sub[key]);
      wrap.appendChild(input);
    }
    input.dataset.sub = key;
    input.dataset.type = type;
    wrap.appendChild(el("div", { class: "muted help" }, help));
    grid.appendChild(wrap);
  }
  row.appendChild(grid);
  row._subset = sub;  // keys the form does not show are kept
  return row;
}
function readFolders() {
  const rows = document.querySelectorAll("#folder-rows .folder-row");
  if (!rows.length) return;
  const out = [];
  for (const row of rows) {
    const sub = { ...row._subset };
    for (const input of row.querySelectorAll("[data-sub]")) {
      const key = input.dataset.sub;
      const v = key === "image_dir" ? (input.value.trim() || undefined) : parseValue(input.dataset.type, input);
      if (v === undefined) delete sub[key]; else sub[key] = v;
    }
    out.push(sub);
  }
  datasetNode(settings.dataset, "datasets.0", true).subsets = out;
}

// the server-side folder picker and the thumbnail strip of one folder row
function addFolderPicker(wrap, input) {
  const browse = el("button", { type: "button", class: "browse-btn" }, "Browse...");
  const info = el("div", { class: "muted folder-info" });
  const strip = el("div", { class: "thumbs" });
  const picker = el("div", { class: "picker" });
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
    const use = el("button", { type: "button", class: "primary use-folder" }, `Use this folder (${f.images} images)`);
    use.addEventListener("click", () => { input.value = f.path; picker.hidden = true; input.dispatchEvent(new Event("change")); });
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
    li.dataset.path = d.path;
    li.addEventListener("click", () => action(() => openFolder(d.path, picker, input)));
    ul.appendChild(li);
  }
  picker.appendChild(ul);
}

// --- Hardware Allocation and Multi-GPU Optimization (launch.toml) -----------------------------------------------
function renderGpus(fs) {
  const ul = el("ul", { id: "gpus", class: "gpus" });
  const chosen = settings.launch.gpu_ids || [];
  if (!gpuList.length) ul.appendChild(el("li", { class: "muted" }, "No GPU: training runs on CPU"));
  for (const g of gpuList) {
    const li = el("li", { class: "field", "data-field": "gpu_ids" });
    const box = el("input", { type: "checkbox", class: "gpu-pick", id: `gpu-${g.index}` });
    box.value = String(g.index);
    box.checked = chosen.includes(g.index);
    const lab = el("label", { for: `gpu-${g.index}` });
    lab.appendChild(box);
    lab.appendChild(document.createTextNode(` GPU ${g.index}: ${g.name} · ${g.memory_used_mib} / ${g.memory_total_mib} MiB · ${g.utilization_percent}% busy`));
    li.appendChild(lab);
    ul.appendChild(li);
  }
  fs.appendChild(ul);
  fs.appendChild(el("p", { class: "muted help" }, "The run sees only the chosen GPUs (CUDA_VISIBLE_DEVICES) and starts one process per GPU (--num_processes); none chosen: the trainer's default device."));
  fs.addEventListener("change", () => { const info = $("strategy-processes"); if (info) info.textContent = processesText(); });
}
function processesText() {
  const n = document.querySelectorAll(".gpu-pick:checked").length;
  if (n) return `${n} process(es), one per chosen GPU (CUDA_VISIBLE_DEVICES, --num_processes)`;
  return gpuList.length ? "1 process: choose GPUs above for more" : "No GPU: one process on the CPU (accelerate --cpu)";
}
function renderMultiGpu(fs) {
  const wrap = el("div", { class: "field", "data-field": "strategy" });
  wrap.appendChild(el("label", { for: "f-strategy" }, "Strategy"));
  const sel = el("select", { id: "f-strategy" });
  sel.appendChild(el("option", { value: "" }, "(none: no accelerate config)"));
  for (const [key, [label]] of Object.entries(STRATEGIES)) {
    // without GPUs accelerate launch starts one process (its multi-CPU mode needs mpirun): single only
    const needsGpu = !gpuList.length && key !== "single";
    const opt = el("option", { value: key }, needsGpu ? `${label} (needs GPUs)` : label);
    opt.disabled = needsGpu;
    sel.appendChild(opt);
  }
  sel.value = settings.launch.strategy || "";
  wrap.appendChild(sel);
  fs.appendChild(wrap);
  const details = el("div", { id: "strategy-details" });
  fs.appendChild(details);
  const draw = () => {
    details.textContent = "";
    const s = sel.value;
    if (!s) { details.appendChild(el("p", { class: "muted" }, "Select a strategy to see details")); return; }
    details.appendChild(el("p", { class: "strategy-about" }, STRATEGIES[s][1]));
    details.appendChild(el("p", { class: "muted", id: "strategy-processes" }, processesText()));
    const grid = el("div", { class: "fields" });
    for (const [key, label, type, help, strategies, dflt] of STRATEGY_FIELDS) {
      if (!strategies.includes(s)) continue;
      const name = key.replace(/^config:/, "");
      let value = key.startsWith("config:") ? configValue(name) : settings.launch[name];
      if (value === undefined) value = dflt;
      const f = renderField({ file: "launch", key: name, label, help, type: type.startsWith("select:") ? "select" : type,
        choices: type.startsWith("select:") ? type.slice(7).split("|") : null }, value);
      f.dataset.strategyKey = key;
      if (name === "fsdp_min_num_params") f.classList.add("size-wrap");
      grid.appendChild(f);
    }
    details.appendChild(grid);
    const policy = details.querySelector('[data-key="fsdp_wrap_policy"]');
    const size = details.querySelector(".size-wrap");
    if (policy && size) { const upd = () => { size.hidden = policy.value !== "SIZE_BASED_WRAP"; }; policy.addEventListener("change", upd); upd(); }
  };
  sel.addEventListener("change", draw);
  draw();
}
function readLaunch() {
  const launch = {};
  const ids = Array.from(document.querySelectorAll(".gpu-pick:checked")).map((b) => Number(b.value));
  if (ids.length) launch.gpu_ids = ids;
  const sel = $("f-strategy");
  const strategy = sel ? sel.value : "";
  if (strategy) launch.strategy = strategy;
  for (const [key, , type, , strategies, dflt] of STRATEGY_FIELDS) {
    const name = key.replace(/^config:/, "");
    const input = document.querySelector(`#strategy-details [data-key="${name}"]`);
    const on = strategies.includes(strategy) && input && !input.closest("[hidden]");
    let v = on ? (type === "bool" ? input.checked : parseValue(type.startsWith("select:") ? "text" : type, input)) : undefined;
    if (name === "zero_stage" && v !== undefined) v = Number(v);
    // a trainer flag at its default is left out of config.toml (false, or the select's default such as "auto")
    if (key.startsWith("config:")) setConfig(name, v === false || v === dflt ? undefined : v, "distributed");
    else if (v !== undefined) launch[name] = v;
  }
  settings.launch = launch;
}

// --- Sample prompts ------------------------------------------------------------------------------------------------
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

// --- Settings history ---------------------------------------------------------------------------------------------
async function loadHistory() {
  if (!current) return;
  const list = await api("GET", `/api/jobs/${current.id}/revisions`);
  const ul = $("history");
  ul.textContent = "";
  list.forEach((r, i) => {
    const li = el("li", { "data-revision": String(r.id) });
    li.appendChild(el("span", { class: "when" }, new Date(r.created * 1000).toLocaleString()));
    li.appendChild(el("span", { class: "what" }, r.changes));
    if (i > 0) {  // the newest is what the form shows
      const b = el("button", { type: "button", class: "restore-btn" }, "Restore");
      b.addEventListener("click", () => action(async () => {
        if (!confirm(`Restore the settings saved at ${new Date(r.created * 1000).toLocaleString()}?`)) return;
        clearErrors();
        setBusy(true, `Restoring revision ${r.id}: running every check Start makes...`);
        try {
          settings = await api("POST", `/api/jobs/${current.id}/revisions/${r.id}/restore`);
        } catch (e) {
          const d = e.detail && typeof e.detail === "object" ? e.detail : { error: e.message };
          onSettingsError(d.field);
          showError(d.error, d.field, d.where);
          return;
        } finally {
          setBusy(false);
        }
        current = await api("GET", `/api/jobs/${current.id}`);
        showJob(current);
        renderForm();
        $("form-ok").textContent = `Restored revision ${r.id}.`;
        $("form-ok").hidden = false;
        loadHistory();
        onSettingsSaved();
      }));
      li.appendChild(b);
    } else li.appendChild(el("span", { class: "muted" }, "current"));
    ul.appendChild(li);
  });
}
