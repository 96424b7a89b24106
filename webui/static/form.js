// The job's settings form: sections of fields (config.toml keys, dataset.toml keys), the dataset folders, the
// Performance options with the server's availability, GPUs and the multi-GPU strategy (launch.toml), the
// settings history. Loaded before app.js; user text is only ever set with textContent / value.
"use strict";

const TE_NAMES = { sd: ["Text encoder (CLIP)"], sdxl: ["Text encoder 1 (CLIP-L)", "Text encoder 2 (OpenCLIP-G)"],
  flux: ["Text encoder 1 (CLIP-L)", "Text encoder 2 (T5-XXL)"],
  sd3: ["Text encoder 1 (CLIP-L)", "Text encoder 2 (CLIP-G)"],  // sd3_train.py trains these two; T5-XXL stays frozen
  anima: ["Text encoder (Qwen3)"], chroma: ["Text encoder (T5-XXL)"], lumina: ["Text encoder (Gemma-2)"],
  hunyuan_image: ["Text encoder (Qwen2.5-VL)", "Text encoder 2 (byT5)"], zimage: ["Text encoder (Qwen3)"] };
// What the Full Finetune Options call the denoiser (--learning_rate) of each family.
const DENOISER_NAMES = { sd: "UNet", sdxl: "UNet", flux: "Transformer", chroma: "Transformer", sd3: "MMDiT", anima: "DiT", lumina: "DiT", hunyuan_image: "DiT", zimage: "DiT" };

// A section is [title, fields] or [title, "custom renderer name", families, mode]. A field is
// [file, key, label, type, help, where (config section or dataset path), families, mode]: "config" keys live in
// any [section] of config.toml (the trainer flattens them); "dataset" keys sit at a path of dataset.toml.
const SECTIONS = [
  ["Model and mode", [
    ["config", "pretrained_model_name_or_path", "Model path", "text", "a .safetensors / .ckpt file, a diffusers folder or a Hub id; tiny:sd1 (tiny:sd3, tiny:anima, tiny:chroma, tiny:lumina, tiny:hunyuan_image, ...) are built-in test models", "model"],
    ["config", "clip_l", "CLIP-L", "text", "FLUX.1 / SD3: the CLIP-L text encoder file (SD3: blank when the model file holds it)", "model", ["flux", "sd3"]],
    ["config", "clip_g", "CLIP-G", "text", "SD3: the OpenCLIP-G text encoder file (blank when the model file holds it)", "model", ["sd3"]],
    ["config", "t5xxl", "T5-XXL", "text", "FLUX.1 / SD3 / Chroma: the T5-XXL text encoder file (SD3: blank when the model file holds it)", "model", ["flux", "sd3", "chroma"]],
    ["config", "ae", "Autoencoder", "text", "FLUX.1 / Chroma / Lumina / Z-Image: the autoencoder file (ae.safetensors)", "model", ["flux", "chroma", "lumina", "zimage"]],
    ["config", "gemma2", "Gemma-2", "text", "Lumina: the Gemma-2 2B text encoder file", "model", ["lumina"]],
    ["config", "system_prompt", "System prompt", "text", "Lumina: put before every caption (sd-scripts' --system_prompt)", "model", ["lumina"]],
    ["config", "text_encoder", "Qwen2.5-VL", "text", "HunyuanImage: the Qwen2.5-VL-7B text encoder file (qwen_2.5_vl_7b.safetensors)", "model", ["hunyuan_image"]],
    ["config", "byt5", "byT5", "text", "HunyuanImage: the glyph byT5 file (byt5_small_glyphxl_fp16.safetensors)", "model", ["hunyuan_image"]],
    ["config", "qwen3", "Qwen3", "text", "Anima: the Qwen3-0.6B text encoder; Z-Image: Qwen3-4B (a .safetensors file or a transformers folder)", "model", ["anima", "zimage"]],
    ["config", "vae", "VAE", "text", "Anima: the Qwen-Image VAE file; HunyuanImage: its VAE file; SD3: replaces the model file's VAE (blank: the model's own)", "model", ["anima", "sd3", "hunyuan_image"]],
    ["config", "llm_adapter_path", "LLM adapter", "text", "Anima: the LLM adapter file (blank: read from the DiT file)", "model", ["anima"]],
    ["config", "t5_tokenizer_path", "T5 tokenizer", "text", "Anima: the T5 tokenizer folder whose ids the adapter embeds (blank: google/t5-v1_1-xxl from the local cache)", "model", ["anima"]],
    ["config", "mixed_precision", "Mixed precision", "select:|no|fp16|bf16", "no on CPU; bf16 on recent GPUs (also written to the accelerate config)", "training"],
  ]],
  ["Optimization", [
    ["config", "optimizer_type", "Optimizer", "text", "AdamW, AdamW8bit, Prodigy, Lion, Adafactor, ...", "optimizer"],
    ["config", "optimizer_args", "Optimizer args", "list", "key=value, space-separated (e.g. weight_decay=0.01 betas=0.9,0.99)", "optimizer"],
    ["config", "learning_rate", "Learning rate", "float", "base learning rate (full fine-tune: the UNet / transformer / DiT's)", "optimizer"],
    ["config", "unet_lr", "UNet / transformer LR", "float", "blank: the base learning rate", "optimizer", null, "lora"],
    ["config", "text_encoder_lr", "Text encoder LR", "float", "blank: the base learning rate", "optimizer", null, "lora"],
    ["config", "lr_scheduler", "Scheduler", "select:|constant|constant_with_warmup|linear|cosine|cosine_with_restarts|polynomial|cosine_with_min_lr|warmup_stable_decay", "learning-rate schedule", "optimizer"],
    ["config", "lr_scheduler_num_cycles", "Restarts count", "int", "cosine_with_restarts: number of cycles (hard restarts)", "optimizer"],
    ["config", "lr_scheduler_min_lr_ratio", "Minimum LR (fraction of initial)", "float", "e.g. 0.1: the schedule never goes below 10% of the initial LR", "optimizer"],
    ["config", "lr_warmup_steps", "Warm-up steps", "text", "steps, or a percentage of the run such as 5%", "optimizer"],
    ["config", "max_grad_norm", "Gradient clipping", "float", "max gradient norm; 0 turns clipping off", "optimizer"],
  ]],
  ["Training Schedule", [
    ["config", "max_train_steps", "Max steps", "int", "train this many optimizer steps", "training"],
    ["config", "max_train_epochs", "Epochs", "int", "overrides max steps when given", "training"],
    ["config", "gradient_accumulation_steps", "Gradient accumulation", "int", "batches per optimizer step", "training"],
    ["config", "save_every_n_steps", "Save every N steps", "int", "a model file (and a state) every N steps", "training"],
    ["config", "save_every_n_epochs", "Save every N epochs", "int", "a model file (and a state) every N epochs", "training"],
    ["config", "save_last_n_steps", "Keep saves of last N steps", "int", "older step saves are removed", "training"],
    ["config", "seed", "Seed", "int", "blank: a random seed, recorded in the outputs", "training"],
    ["config", "output_name", "Output name", "text", "file name of the trained model (in the job's output/ folder)", "output"],
  ]],
  ["Caching", [
    ["config", "cache_latents", "Cache latents", "bool", "encode every image once before training (no color_aug / random_crop)", "caching"],
    ["config", "cache_latents_to_disk", "Cache latents to disk", "bool", "keep the latent cache next to the images between runs", "caching"],
    ["config", "vae_batch_size", "VAE batch size", "int", "images per VAE batch while caching", "caching"],
    ["config", "cache_text_encoder_outputs", "Cache text-encoder outputs", "bool", "SDXL / FLUX.1 / SD3 / Anima / Chroma: the text encoders stay frozen", "caching", ["sdxl", "flux", "sd3", "anima", "chroma", "lumina", "hunyuan_image", "zimage"]],
  ]],
  ["Performance", "performance"],
  ["Dataset Folders", "folders"],
  ["Global Dataset Settings", [
    ["dataset", "caption_extension", "Caption extension", "text", "default for every folder: .txt or .caption", "general"],
    ["dataset", "resolution", "Resolution(s)", "resolution", "one size (512) or several, comma-separated (512,768,1024)", "datasets.0"],
    ["dataset", "batch_size", "Batch size (per resolution)", "intlist", "one number, or one per resolution, comma-separated (4,2,1)", "datasets.0"],
    ["dataset", "resolution_schedule", "Resolution schedule", "select:|all|progressive", "progressive: train low to high resolution (needs 2 or more resolutions)", "datasets.0"],
    ["dataset", "resolution_step_fractions", "Step fractions", "floatlist", "progressive: fraction of the steps per resolution, comma-separated, summing to 1.0", "datasets.0"],
    ["config", "shuffle_caption", "Shuffle caption tags", "bool", "shuffle the comma-separated tags every step", "dataset"],
    ["config", "flip_aug", "Flip augmentation", "bool", "random horizontal flips", "dataset"],
    ["config", "alpha_mask", "Alpha channel as loss mask", "bool", "transparent pixels do not count in the loss", "dataset"],
  ]],
  ["Bucketing", [
    ["dataset", "enable_bucket", "Aspect-ratio buckets", "bool", "images keep their aspect ratio, batched by bucket", "datasets.0"],
    ["dataset", "min_bucket_reso", "Smallest bucket side", "int", "pixels (default 256)", "datasets.0"],
    ["dataset", "max_bucket_reso", "Largest bucket side", "int", "pixels (default 1024)", "datasets.0"],
    ["dataset", "bucket_reso_steps", "Bucket step", "int", "bucket sides are multiples of this (64 for SD 1.x / 2.x)", "datasets.0"],
    ["dataset", "bucket_no_upscale", "No upscale", "bool", "never enlarge an image to fill a bucket", "datasets.0"],
  ]],
  ["LoRA Configuration", [
    ["config", "network_module", "Network module", "select:networks.lora|networks.lora_flux|networks.lora_sd3|networks.lora_anima|networks.lora_lumina|networks.lora_hunyuan_image|lycoris.kohya", "LoRA, or LyCORIS kinds through lycoris.kohya and network args (algo=loha ...)", "network", null, "lora"],
    ["config", "network_dim", "Dim (rank)", "int", "rank of each LoRA module", "network", null, "lora"],
    ["config", "network_alpha", "Alpha", "float", "scale = alpha / dim", "network", null, "lora"],
    ["config", "network_dropout", "Dropout", "float", "neuron dropout, 0 to 1", "network", null, "lora"],
    ["config", "network_args", "Network args", "list", "key=value, space-separated", "network", null, "lora"],
    ["config", "network_train_unet_only", "Freeze text encoders", "bool", "train the UNet / transformer only", "network", null, "lora"],
    ["config", "network_weights", "Initialise from LoRA", "text", "an existing LoRA file to start from (its rank and modules)", "network", null, "lora"],
  ]],
  ["Full Finetune Options", "finetune", null, "finetune"],
  ["Resume", [
    ["config", "resume", "Auto-resume", "resume", "continue from the newest saved state in the job's output folder (Stop saves one); off: a state folder to start from, or blank", "training"],
    ["config", "save_state", "Save states", "bool", "a training state with every save (needed to resume)", "training"],
  ]],
  ["Sampling", [
    ["config", "sample_every_n_steps", "Sample every N steps", "int", "needs at least one prompt below", "sampling"],
    ["config", "sample_every_n_epochs", "Sample every N epochs", "int", "needs at least one prompt below", "sampling"],
    ["config", "sample_sampler", "Sampler", "select:|ddim|euler|euler_a|dpmsolver++|k_dpm_2|lms|pndm|flow_euler", "sampler of the sample images", "sampling"],
  ]],
  ["Diagnostics", "diagnostics"],
  ["Hardware Allocation", "gpus"],
  ["Multi-GPU Optimization", "multigpu"],
];

const FT_FIELDS = [
  ["config", "block_lr", "Per-block LRs (SDXL)", "text", "23 comma-separated rates (embeddings, IN00-IN08, MID0-MID2, OUT00-OUT08, out); 0 freezes a block", "optimizer", ["sdxl"], "finetune"],
  ["config", "save_model_as", "Save as", "select:|safetensors|ckpt|diffusers|diffusers_safetensors", "file format of the trained model", "output", null, "finetune"],
  ["config", "use_ema", "EMA weights", "bool", "keep an exponential moving average of the weights and save it", "training", null, "finetune"],
  ["config", "fused_backward_pass", "Fused backward pass", "bool", "step each parameter as soon as its gradient is in: less memory", "optimizer", null, "finetune"],
  ["config", "self_attn_lr", "DiT self-attention LR", "float", "Anima: --self_attn_lr; blank: the base rate, 0 freezes them", "optimizer", ["anima"], "finetune"],
  ["config", "cross_attn_lr", "DiT cross-attention LR", "float", "Anima: --cross_attn_lr; blank: the base rate, 0 freezes them", "optimizer", ["anima"], "finetune"],
  ["config", "mlp_lr", "DiT MLP LR", "float", "Anima: --mlp_lr; blank: the base rate, 0 freezes them", "optimizer", ["anima"], "finetune"],
  ["config", "mod_lr", "DiT modulation LR", "float", "Anima: --mod_lr (AdaLN modulation); blank: the base rate, 0 freezes it", "optimizer", ["anima"], "finetune"],
];

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

let perfOptions = [];   // the server's availability of the Performance options for the selected job
let gpuList = [];       // the GPUs the server found

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
  const [file, key, , , , where] = f;
  if (file === "config") return configValue(key);
  const node = datasetNode(settings.dataset, where, false);
  return node ? node[key] : undefined;
}
function setValue(f, value) {
  const [file, key, , , , where] = f;
  if (file === "config") { setConfig(key, value, where); return; }
  const node = datasetNode(settings.dataset, where, value !== undefined);
  if (!node) return;
  if (value === undefined) delete node[key]; else node[key] = value;
}
function shown(f) { return (!f[6] || f[6].includes(current.family)) && (!f[7] || f[7] === current.mode); }

// --- rendering ------------------------------------------------------------------------------------------------
function renderForm() {
  const box = $("sections");
  box.textContent = "";
  settings.launch = settings.launch || {};
  for (const [title, fields, families, mode] of SECTIONS) {
    if ((families && !families.includes(current.family)) || (mode && mode !== current.mode)) continue;
    const fs = el("fieldset", { "data-section": title });
    fs.appendChild(el("legend", {}, title));
    if (typeof fields === "string") {
      RENDERERS[fields](fs);
    } else {
      const visible = fields.filter(shown);
      if (!visible.length) continue;
      const grid = el("div", { class: "fields" });
      for (const f of visible) grid.appendChild(renderField(f));
      fs.appendChild(grid);
    }
    box.appendChild(fs);
  }
  renderPrompts();
  updateDependencies();
  afterRender();  // app.js: the tabs and the check's marks
}

function inputFor(f, value) {
  const [, key, label, type] = f;
  const id = "f-" + key;
  let input;
  if (type === "bool" || type === "resume") {
    input = el("input", { type: "checkbox", id });
    input.checked = type === "resume" ? value === "auto" : Boolean(value);
    return [input, (() => { const lab = el("label", { for: id }); lab.appendChild(input); lab.appendChild(document.createTextNode(label)); return lab; })()];
  }
  if (type.startsWith("select:")) {
    input = el("select", { id });
    const options = type.slice(7).split("|");
    if (value !== undefined && !options.includes(String(value))) options.push(String(value));
    for (const o of options) input.appendChild(el("option", { value: o }, o || "(default)"));
    input.value = value === undefined ? "" : String(value);
  } else {
    input = el("input", { id, type: "text" });
    if (type === "int" || type === "float") input.inputMode = "decimal";
    if (value === undefined) input.value = "";
    else if (Array.isArray(value)) input.value = type === "list" ? value.join(" ") : value.join(",");
    else input.value = String(value);
  }
  return [input, el("label", { for: id }, label)];
}

function renderField(f, value) {
  const [, key, , type, help] = f;
  const wrap = el("div", { class: "field", "data-field": key, title: help || "" });
  if (value === undefined && f[0] !== "launch") value = getValue(f);
  const [input, label] = inputFor(f, value);
  if (type === "bool" || type === "resume") { wrap.classList.add("checkbox"); wrap.appendChild(label); }
  else { wrap.appendChild(label); wrap.appendChild(input); }
  input.name = key;
  input.dataset.key = key;
  if (help) wrap.appendChild(el("div", { class: "muted help" }, help));
  if (type === "resume") {  // a state folder, blank (and off) while auto-resume is on
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
  if (type === "floatlist" || type === "intlist") {
    const parts = raw.split(",").map((x) => x.trim()).filter(Boolean);
    if (!parts.every((x) => !isNaN(Number(x)))) return raw;
    return type === "intlist" && parts.length === 1 ? Number(parts[0]) : parts.map(Number);
  }
  if (type === "resolution") {
    const parts = raw.split(",").map((s) => s.trim()).filter(Boolean);
    return parts.every((p) => /^\d+$/.test(p)) ? (parts.length === 1 ? Number(parts[0]) : parts.map(Number)) : raw;
  }
  return raw;  // the trainer's parser says what is wrong with a non-number
}

// --- Performance: the server says what this machine, the family and the trainer can use --------------------
function renderPerformance(fs) { renderOptions(fs, "performance"); }
function renderDiagnostics(fs) { renderOptions(fs, "diagnostics"); }
function renderOptions(fs, group) {
  const grid = el("div", { class: "fields" });
  if (group === "performance") grid.appendChild(renderField(["config", "max_data_loader_n_workers", "Data-loader workers", "int", "processes loading images (default 8, capped at the CPU count); 0 loads them in the training process", "dataset"]));
  for (const o of perfOptions.filter((p) => p.group === group)) {
    let wrap;
    if (o.kind === "memory") {
      const value = configValue("highvram") ? "highvram" : configValue("lowram") ? "lowram" : "";
      wrap = renderField(["config", "memory", o.label, "select:|highvram|lowram", o.help, o.section], value);
      const sel = wrap.querySelector("select");
      for (const opt of sel.options) opt.textContent = { "": "(default)", highvram: "VRAM (--highvram)", lowram: "RAM (--lowram)" }[opt.value];
    } else if (o.kind.startsWith("choice:")) {
      wrap = renderField(["config", o.key, o.label, "select:|" + o.kind.slice(7), o.help, o.section]);
    } else {
      wrap = renderField(["config", o.key, o.label, o.kind, o.help, o.section]);
    }
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
    const input = wrap.querySelector("input, select");
    input.disabled = !ok;
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
  const workers = document.querySelector('#sections [data-key="max_data_loader_n_workers"]');
  if (workers) setConfig("max_data_loader_n_workers", parseValue("int", workers), "dataset");
}

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

// --- Full Finetune Options: what trains, per component -----------------------------------------------------------
function renderFinetune(fs) {
  const table = el("table", { class: "components" });
  const head = el("tr");
  for (const h of ["Component", "Train", "Learning rate"]) head.appendChild(el("th", {}, h));
  table.appendChild(head);
  const lr = configValue("learning_rate");
  const unet = el("tr", { "data-field": "learning_rate" });
  unet.appendChild(el("td", {}, DENOISER_NAMES[current.family] || "UNet"));
  const unetTrain = el("input", { type: "checkbox", id: "f-train_unet" });
  unetTrain.checked = lr !== 0;
  const td = el("td"); td.appendChild(unetTrain); unet.appendChild(td);
  unet.appendChild(el("td", { class: "muted" }, "the Optimization learning rate (off: --learning_rate 0, frozen)"));
  table.appendChild(unet);
  if (current.family === "anima") table.appendChild(adapterRow());
  const names = TE_NAMES[current.family] || [];
  const te = el("tr", { "data-field": "train_text_encoder", class: "field" });
  te.appendChild(el("td", {}, names.length === 1 ? names[0] : current.family === "sd3" ? "Text encoders (CLIP-L, CLIP-G; T5-XXL stays frozen)" : "Text encoder(s)"));
  const teTrain = el("input", { type: "checkbox", id: "f-train_text_encoder", "data-key": "train_text_encoder" });
  teTrain.checked = Boolean(configValue("train_text_encoder"));
  const td2 = el("td"); td2.appendChild(teTrain); te.appendChild(td2);
  const teLr = el("td"); teLr.appendChild(lrInput("learning_rate_te", "every text encoder (--learning_rate_te); blank: the base LR"));
  te.appendChild(teLr);
  table.appendChild(te);
  names.forEach((name, i) => {
    if (names.length < 2) return;  // one encoder: --learning_rate_te is its rate
    const key = `learning_rate_te${i + 1}`;
    const row = el("tr", { "data-field": key, class: "field" });
    row.appendChild(el("td", {}, name));
    row.appendChild(el("td", { class: "muted" }, "0 freezes it"));
    const c = el("td"); c.appendChild(lrInput(key, `--${key}: this encoder only`)); row.appendChild(c);
    table.appendChild(row);
  });
  fs.appendChild(table);
  fs.appendChild(el("p", { class: "muted help" }, "As the fine-tune scripts: the UNet / transformer / DiT trains unless --learning_rate is 0; with --train_text_encoder each encoder trains at its own rate, else --learning_rate_te, else the base rate; a rate of 0 keeps that encoder frozen."));
  const grid = el("div", { class: "fields" });
  for (const f of FT_FIELDS.filter(shown)) grid.appendChild(renderField(f));
  fs.appendChild(grid);
  const sync = () => { for (const i of te.querySelectorAll("input[type=text]")) i.disabled = !teTrain.checked; for (const i of table.querySelectorAll("tr[data-field^=learning_rate_te] input")) i.disabled = !teTrain.checked; };
  teTrain.addEventListener("change", sync);
  sync();
}
// Anima: the LLM adapter trains at --llm_adapter_lr (blank: the base rate); "frozen" is --llm_adapter_lr 0.
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
  c.appendChild(lab);
  c.appendChild(lr);
  row.appendChild(c);
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
      const f = renderField(["launch", name, label, type, help], value);
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
  for (const [key, , type, , strategies] of STRATEGY_FIELDS) {
    const name = key.replace(/^config:/, "");
    const input = document.querySelector(`#strategy-details [data-key="${name}"]`);
    const on = strategies.includes(strategy) && input && !input.closest("[hidden]");
    let v = on ? (type === "bool" ? input.checked : parseValue(type.startsWith("select:") ? "text" : type, input)) : undefined;
    if (name === "zero_stage" && v !== undefined) v = Number(v);
    if (key.startsWith("config:")) setConfig(name, v === false ? undefined : v, "distributed");
    else if (v !== undefined) launch[name] = v;
  }
  settings.launch = launch;
}

const RENDERERS = { performance: renderPerformance, diagnostics: renderDiagnostics, folders: renderFolders, finetune: renderFinetune,
  gpus: renderGpus, multigpu: renderMultiGpu };

// --- reading the form, saving, errors ---------------------------------------------------------------------------
function readForm() {
  for (const [, fields] of SECTIONS) {
    if (typeof fields === "string") continue;
    for (const f of fields) {
      const input = document.querySelector(`#sections [data-key="${f[1]}"]`);
      if (!input) continue;
      if (f[3] === "resume") {
        const path = $("f-resume_path").value.trim();
        setValue(f, input.checked ? "auto" : (path || undefined));
      } else setValue(f, parseValue(f[3], input));
    }
  }
  for (const f of FT_FIELDS) {
    const input = document.querySelector(`#sections [data-key="${f[1]}"]`);
    if (input) setValue(f, parseValue(f[3], input));
  }
  readPerformance();
  readFolders();
  readFinetune();
  readLaunch();
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
  let hw;
  [perfOptions, settings, hw] = await Promise.all([api("GET", `/api/jobs/${job.id}/performance`),
    api("GET", `/api/jobs/${job.id}/settings`), api("GET", "/api/hardware")]);
  gpuList = hw.gpus;
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
