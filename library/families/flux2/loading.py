"""Load FLUX.2 klein from the files users have, and write the tiny preset in the same layouts.

- a diffusers folder (black-forest-labs/FLUX.2-klein-4B and -9B, -base: model_index.json, transformer/, vae/,
  text_encoder/, tokenizer/), read by diffusers' and transformers' own from_pretrained;
- the DiT as one `.safetensors` in BFL's names (ComfyUI's flux-2-klein-4b.safetensors: `double_blocks.N.img_attn.qkv`,
  `single_blocks.N.linear1`, `img_in`, ...) or ComfyUI's whole-model file (`model.diffusion_model.*`), converted by
  diffusers' own single-file converter; with
- --qwen3: Qwen3 as one file (`model.*` keys as ComfyUI's qwen_3_4b.safetensors, or bare `layers.*`) or a
  transformers folder, and --ae: the FLUX.2 autoencoder (flux2-vae.safetensors: LDM names and the `bn.*` statistics);
- the Qwen tokenizer: the tiny one for the tiny encoder, else Qwen/Qwen3-4B from --tokenizer_cache_dir or the local
  HF cache (Qwen3-4B and -8B share it).

Every single-file configuration is read from tensor shapes; models are built on the meta device and adopt the tensors.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from library.core.safetensors_io import write_safetensors
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.qwen3 import load_qwen3
from library.families.common import ldm_layout as ldm
from library.families.common.loading import (adopt, classify_source, infer_vae_config,
                                             load_folder_parts, read_file)
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.flux2 import layout
from library.families.flux2.configs import (
    LATENT_CHANNELS,
    PATCHED_CHANNELS,
    PRESETS,
    QWEN3_TOKENIZER_REPO,
    build_flux2_modules,
    build_qwen3_tokenizer,
    transformer_config,
    vae_config,
)
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

_DIT_MARKER = re.compile(r"^(model\.diffusion_model\.)?double_blocks\.0\.img_attn\.qkv\.")
FOLDER_PARTS = ("transformer", "vae", "text_encoder", "tokenizer")
BN_KEYS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def flux2_source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file" (a ModelLoadError naming the problem otherwise)."""
    return classify_source(path, PRESETS, "FLUX.2", folder_parts=FOLDER_PARTS, file_suffixes=(".safetensors",),
                           expected="a FLUX.2 diffusers folder, a FLUX.2 DiT .safetensors file or the preset "
                                    "tiny:flux2")


def load_dit_file(path: str, dtype: torch.dtype, label: str = "--pretrained_model_name_or_path"):
    """Flux2Transformer2DModel from an original FLUX.2 file (or ComfyUI's whole-model file)."""
    Flux2Transformer2DModel = diffusers_class("Flux2Transformer2DModel")

    tensors = layout.strip_prefix(read_file(label, path, "a FLUX.2 DiT (double_blocks.*.img_attn.qkv keys)",
                                             lambda keys: any(_DIT_MARKER.match(k) for k in keys), dtype))
    try:
        shape = layout.infer_shape(tensors)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete FLUX.2 DiT, no tensor for {e.args[0]}") from None
    if shape["patch_in"] != PATCHED_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected a DiT on {LATENT_CHANNELS} latent channels in 2x2 patches "
                             f"({PATCHED_CHANNELS}), found img_in input {shape['patch_in']} (a FLUX.1 file?)")
    head_dim = shape["head_dim"]
    if head_dim % 8:
        raise ModelLoadError(f"{label} {path}: head width {head_dim} does not split into FLUX.2's four RoPE axes")
    inner = shape["heads"] * head_dim
    config = transformer_config(PRESETS["random:flux2"]) | dict(
        num_layers=shape["double_layers"], num_single_layers=shape["single_layers"], attention_head_dim=head_dim,
        num_attention_heads=shape["heads"], joint_attention_dim=shape["joint_attention_dim"],
        mlp_ratio=shape["mlp_hidden"] / inner, axes_dims_rope=(head_dim // 4,) * 4,
        guidance_embeds=shape["guidance_embeds"])
    return adopt(label, path, lambda: Flux2Transformer2DModel(**config), layout.to_diffusers(tensors))






def load_ae_file(path: str, dtype: torch.dtype = torch.float32):
    """AutoencoderKLFlux2 from the FLUX.2 AE file (LDM VAE keys without prefix, 32 latent channels, `bn.*`)."""
    AutoencoderKLFlux2 = diffusers_class("AutoencoderKLFlux2")

    label = "--ae"
    ckpt = read_file(label, path, "the FLUX.2 autoencoder (flux2-vae.safetensors: encoder.*, decoder.*, bn.*)",
                     lambda keys: "encoder.conv_in.weight" in keys and "bn.running_mean" in keys, dtype)
    try:
        found = infer_vae_config(ckpt, "")
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: autoencoder tensors are incomplete ({e})") from None
    if found["latent_channels"] != LATENT_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected the FLUX.2 autoencoder with {LATENT_CHANNELS} latent "
                             f"channels, found {found['latent_channels']}")
    config = {**vae_config(found["block_out_channels"]), "layers_per_block": found["layers_per_block"]}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoencoderKLFlux2(**config).state_dict().items()}
    vae_shapes = {k: s for k, s in shapes.items() if not k.startswith("bn.")}
    try:
        state_dict = ldm.pull(ckpt, ldm.vae_key_map(vae_shapes, ""), vae_shapes)
    except (ldm.LayoutError, ValueError) as e:
        raise ModelLoadError(f"{label} {path}: autoencoder tensors are incomplete or mis-shaped ({e})") from None
    state_dict.update({k: ckpt[k] for k in BN_KEYS if k in ckpt})
    if "bn.num_batches_tracked" not in state_dict:
        state_dict["bn.num_batches_tracked"] = torch.tensor(0)
    return adopt(label, path, lambda: AutoencoderKLFlux2(**config), state_dict)


def ae_file_tensors(vae) -> dict[str, torch.Tensor]:
    """An AutoencoderKLFlux2 as the original AE file's tensors (LDM names, `bn.*` as they are)."""
    state = vae.state_dict()
    vae_state = {k: v for k, v in state.items() if not k.startswith("bn.")}
    out = ldm.push(vae_state, ldm.vae_key_map(vae_state.keys(), ""))
    out.update({k: state[k] for k in BN_KEYS})
    return out


def load_folder(path: str, scratch_seed: Optional[int]) -> dict:
    """The four parts of a diffusers FLUX.2 klein folder, by the libraries' own from_pretrained (the text encoder,
    saved as Qwen3ForCausalLM, read as its Qwen3Model: the LM head is not used)."""
    AutoencoderKLFlux2, Flux2Transformer2DModel = diffusers_classes("AutoencoderKLFlux2", "Flux2Transformer2DModel")
    from transformers import AutoTokenizer, Qwen3Model

    parts = load_folder_parts(path, {"transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2,
                                     "text_encoder": Qwen3Model, "tokenizer": AutoTokenizer}, "FLUX.2",
                              scratch=None if scratch_seed is None else ("transformer", scratch_seed))
    parts["tokenizer"].padding_side = "right"
    return parts


def load_flux2_components(opts: LoadOptions, options) -> Components:
    """Components of FLUX.2 klein: denoiser = Flux2Transformer2DModel, text encoders = [Qwen3Model],
    tokenizers = [Qwen's], vae = AutoencoderKLFlux2 (`options`: Flux2Options with --qwen3 / --ae)."""
    path = opts.pretrained_model_name_or_path
    kind = flux2_source_kind(path)
    ae_path = options.ae or opts.vae
    scratch_done = False
    if kind == "single_file":
        if not options.qwen3:
            raise ModelLoadError(f"--qwen3: required with a FLUX.2 DiT file ({path})")
        transformer = load_dit_file(path, opts.dtype)
        text_encoder, tokenizer = load_qwen3(options.qwen3, opts.dtype, opts.tokenizer_cache_dir, tokenizer_repo=QWEN3_TOKENIZER_REPO,
                                                   tiny_tokenizer=build_qwen3_tokenizer)
        vae = load_ae_file(ae_path, opts.vae_dtype) if ae_path else None  # the LoRA tools need no AE
    else:
        if kind == "diffusers":
            parts = load_folder(path, opts.init_seed if opts.from_scratch else None)
            scratch_done = opts.from_scratch
        else:
            parts = build_flux2_modules(path)
        transformer, vae = parts["transformer"], parts["vae"]
        text_encoder, tokenizer = parts["text_encoder"], parts["tokenizer"]
        if options.qwen3:
            text_encoder, tokenizer = load_qwen3(options.qwen3, opts.dtype, opts.tokenizer_cache_dir, tokenizer_repo=QWEN3_TOKENIZER_REPO,
                                                   tiny_tokenizer=build_qwen3_tokenizer)
        if ae_path:
            vae = load_ae_file(ae_path, opts.vae_dtype)
    if transformer.config.guidance_embeds:
        raise ModelLoadError(f"{path}: a guidance-distilled FLUX.2 [dev] DiT (it has guidance_in); this release "
                             f"trains FLUX.2 [klein] (Qwen3 text) only")
    if opts.from_scratch and not scratch_done:
        from library.families.common.loading import scratch_denoiser

        transformer = scratch_denoiser(transformer, opts.init_seed)
    for module, dtype in ((transformer, opts.dtype), (text_encoder, opts.dtype), (vae, opts.vae_dtype)):
        if module is not None and next(module.parameters()).dtype != dtype:
            module.to(dtype=dtype)
    return Components(denoiser=transformer, vae=vae, text_encoders=[text_encoder], tokenizers=[tokenizer],
                      model_path=path, vae_path=ae_path)


def check_model_source(path: str, options, vae: Optional[str]) -> None:
    """The checks of load_flux2_components that need no weights (one-line ModelLoadError)."""
    if flux2_source_kind(path) == "single_file":
        for flag, value in (("qwen3", options.qwen3), ("ae", options.ae or vae)):
            if not value:
                raise ModelLoadError(f"--{flag}: required with a FLUX.2 DiT file ({path})")


def block_counts(path: str) -> Optional[tuple[int, int]]:
    """(double, single) blocks of a preset, folder or DiT file, read without loading weights; None when unknown."""
    try:
        kind = flux2_source_kind(path)
        if kind == "preset":
            return PRESETS[path].double_layers, PRESETS[path].single_layers
        if kind == "diffusers":
            with open(os.path.join(path, "transformer", "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            return int(config["num_layers"]), int(config["num_single_layers"])
        double = indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?double_blocks\.(\d+)\.")
        single = indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?single_blocks\.(\d+)\.")
        return (double, single) if double and single else None
    except (OSError, ValueError, KeyError, ModelLoadError):
        return None


# --- writing -------------------------------------------------------------------------------------------

def write_dit_file(transformer, path: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict] = None) -> str:
    """The DiT as one original-layout file (BFL's / ComfyUI's names)."""
    write_safetensors(layout.to_original(transformer.state_dict()), path, metadata or {}, dtype=dtype)
    return path


def scheduler():
    """FLUX.2 klein's scheduler config: flow-match Euler, dynamic exponential shift (μ from the image size)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def text_encoder_for_pipeline(text_encoder):
    """The Qwen3Model inside a Qwen3ForCausalLM (the class the klein folder holds; its head tied, nothing new)."""
    from transformers import Qwen3ForCausalLM

    config = text_encoder.config
    with torch.device("meta"):
        full = Qwen3ForCausalLM(config)
    full.model = text_encoder
    full.lm_head.weight = text_encoder.embed_tokens.weight
    return full.eval()


def write_diffusers_folder(parts: dict, out_dir: str) -> str:
    """A diffusers Flux2KleinPipeline folder of `parts` (model_index.json, transformer/, vae/, text_encoder/ as
    Qwen3ForCausalLM, tokenizer/, scheduler/), by the libraries' own save_pretrained."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline(scheduler=scheduler(), vae=parts["vae"],
                              text_encoder=text_encoder_for_pipeline(parts["text_encoder"]),
                              tokenizer=parts["tokenizer"], transformer=parts["transformer"], is_distilled=True)
    pipe.save_pretrained(out_dir)
    return out_dir


def write_flux2_preset(name: str, out_dir: str) -> dict[str, str]:
    """A preset written as the files users have: the diffusers folder (`diffusers/`), and ComfyUI's single files:
    the DiT (flux-2-klein-tiny.safetensors, BFL names), qwen_3_4b.safetensors (`model.*` keys) and
    flux2-vae.safetensors (LDM names, `bn.*`). Returns {"diffusers", "dit", "qwen3", "ae"}."""
    parts = build_flux2_modules(name)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"diffusers": os.path.join(out_dir, "diffusers"),
             "dit": os.path.join(out_dir, "flux-2-klein-tiny.safetensors"),
             "qwen3": os.path.join(out_dir, "qwen_3_4b.safetensors"),
             "ae": os.path.join(out_dir, "flux2-vae.safetensors")}
    write_diffusers_folder(parts, paths["diffusers"])
    write_dit_file(parts["transformer"], paths["dit"])
    write_safetensors({"model." + k: v for k, v in parts["text_encoder"].state_dict().items()}, paths["qwen3"])
    write_safetensors(ae_file_tensors(parts["vae"]), paths["ae"])
    return paths
