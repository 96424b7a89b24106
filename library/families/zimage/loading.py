"""Load Z-Image from the files users have, and write the tiny preset in the same layouts.

- a diffusers folder (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image: model_index.json, transformer/, vae/,
  text_encoder/, tokenizer/), read by diffusers' and transformers' own from_pretrained;
- the DiT as one `.safetensors` in the original names (Comfy-Org's z_image_turbo_bf16.safetensors,
  `layers.N.attention.qkv`, `x_embedder`, `final_layer`) or ComfyUI's whole-model file (`model.diffusion_model.*`),
  converted by diffusers' own single-file converter; with
- --qwen3: Qwen3-4B as one file (`model.*` keys as ComfyUI's qwen_3_4b.safetensors, or bare `layers.*`) or a
  transformers folder, and --ae: the FLUX.1 autoencoder (BFL's ae.safetensors);
- the Qwen tokenizer: the tiny one for the tiny encoder, else Qwen/Qwen3-4B from --tokenizer_cache_dir or the
  local HF cache.

Every single-file configuration is read from tensor shapes; models are built on the meta device and adopt the tensors.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from library.core.safetensors_io import write_safetensors
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.qwen3 import load_qwen3
from library.families.common.autoencoder import ae_file_tensors, load_ae_file
from library.families.common.gguf_file import GGUF_SUFFIX, adopt_gguf, gguf_keys, is_gguf
from library.families.common.loading import (adopt, classify_source, finish_components, load_dit_parts,
                                             load_folder_parts, part_config, read_dit_file)
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.zimage import layout
from library.families.zimage.configs import (
    LATENT_CHANNELS,
    PRESETS,
    QWEN3_TOKENIZER_REPO,
    build_qwen3_tokenizer,
    build_zimage_modules,
    transformer_config,
)
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

_DIT_MARKER = re.compile(r"^(model\.diffusion_model\.)?layers\.0\.attention\.qkv\.")
FOLDER_PARTS = ("transformer", "vae", "text_encoder", "tokenizer")


def zimage_source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file" (a ModelLoadError naming the problem otherwise)."""
    return classify_source(path, PRESETS, "Z-Image", folder_parts=FOLDER_PARTS,
                           file_suffixes=(".safetensors", GGUF_SUFFIX), gguf=True,
                           expected="a Z-Image diffusers folder, a Z-Image DiT .safetensors or ComfyUI-GGUF .gguf file "
                                    "or the preset tiny:zimage")


def load_dit_file(path: str, dtype: torch.dtype, label: str = "--pretrained_model_name_or_path"):
    """ZImageTransformer2DModel from an original Z-Image file (or ComfyUI's whole-model file), or a ComfyUI-GGUF
    file of it (`general.architecture` "lumina2", as city96's convert.py names Z-Image; quantized weights kept)."""
    ZImageTransformer2DModel = diffusers_class("ZImageTransformer2DModel")

    gguf = is_gguf(path)
    tensors, shape = read_dit_file(label, path, dtype, expected="a Z-Image DiT (layers.*.attention.qkv keys)",
                                   marker=_DIT_MARKER, infer_shape=layout.infer_shape, what="Z-Image DiT",
                                   gguf_archs=("lumina2",))
    if shape["patch_in"] != LATENT_CHANNELS * 4:
        raise ModelLoadError(f"{label} {path}: expected a DiT on {LATENT_CHANNELS} latent channels in 2x2 patches, "
                             f"found x_embedder input {shape['patch_in']}")
    head_dim = shape["head_dim"]
    # Z-Image's RoPE axes (32, 48, 48) of 128; a smaller head keeps the 1:1.5:1.5 split, each axis even
    axes = [head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8]
    if sum(axes) != head_dim or any(a % 2 for a in axes):
        raise ModelLoadError(f"{label} {path}: head width {head_dim} does not split into Z-Image's RoPE axes")
    config = transformer_config(PRESETS["random:zimage"]) | dict(
        dim=shape["dim"], n_layers=shape["layers"], n_refiner_layers=shape["refiner_layers"], n_heads=shape["heads"],
        n_kv_heads=shape["heads"], cap_feat_dim=shape["cap_feat_dim"], axes_dims=axes)
    return (adopt_gguf if gguf else adopt)(label, path, lambda: ZImageTransformer2DModel(**config),
                                           layout.to_diffusers(tensors))






def load_folder(path: str, scratch_seed: Optional[int]) -> dict:
    """The four parts of a diffusers Z-Image folder, by the libraries' own from_pretrained."""
    AutoencoderKL, ZImageTransformer2DModel = diffusers_classes("AutoencoderKL", "ZImageTransformer2DModel")
    from transformers import AutoTokenizer, Qwen3Model

    parts = load_folder_parts(path, {"transformer": ZImageTransformer2DModel, "vae": AutoencoderKL,
                                     "text_encoder": Qwen3Model, "tokenizer": AutoTokenizer}, "Z-Image",
                              scratch=None if scratch_seed is None else ("transformer", scratch_seed))
    parts["tokenizer"].padding_side = "right"
    return parts


def load_text_encoder(path: str, opts: LoadOptions):
    """(Qwen3Model, tokenizer) of --qwen3."""
    return load_qwen3(path, opts.dtype, opts.tokenizer_cache_dir, tokenizer_repo=QWEN3_TOKENIZER_REPO,
                      tiny_tokenizer=build_qwen3_tokenizer)


def load_zimage_components(opts: LoadOptions, options) -> Components:
    """Components of Z-Image: denoiser = ZImageTransformer2DModel, text encoders = [Qwen3Model],
    tokenizers = [Qwen's], vae = the FLUX.1 AE (`options`: ZImageOptions with --qwen3 / --ae)."""
    path = opts.pretrained_model_name_or_path
    kind = zimage_source_kind(path)
    if kind == "single_file" and not options.qwen3:
        raise ModelLoadError(f"--qwen3: required with a Z-Image DiT file ({path})")
    ae_path = options.ae or opts.vae
    parts, scratch_done = load_dit_parts(
        opts, kind, ae_path, dit_file=load_dit_file, ae_file=load_ae_file, preset=build_zimage_modules,
        folder=load_folder, text_file=(lambda: load_text_encoder(options.qwen3, opts)) if options.qwen3 else None)
    return finish_components(opts, parts["transformer"], [parts["text_encoder"]], [parts["tokenizer"]], parts["vae"],
                             ae_path, scratch_done=scratch_done)


def check_model_source(path: str, options, vae: Optional[str]) -> None:
    """The checks of load_zimage_components that need no weights (one-line ModelLoadError)."""
    if zimage_source_kind(path) == "single_file":
        for flag, value in (("qwen3", options.qwen3), ("ae", options.ae or vae)):
            if not value:
                raise ModelLoadError(f"--{flag}: required with a Z-Image DiT file ({path})")


def block_count(path: str) -> Optional[int]:
    """Main blocks (`layers.N`) of a preset, folder or DiT file, read without loading weights; None when unknown."""
    try:
        kind = zimage_source_kind(path)
        if kind == "preset":
            return PRESETS[path].layers
        if kind == "diffusers":
            return int(part_config(path, "transformer")["n_layers"])
        if is_gguf(path):
            return len({m[1] for k in gguf_keys(path) if (m := re.match(r"layers\.(\d+)\.", k))}) or None
        return indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?layers\.(\d+)\.")
    except (OSError, ValueError, KeyError, ModelLoadError):
        return None


# --- writing -------------------------------------------------------------------------------------------

def write_dit_file(transformer, path: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict] = None) -> str:
    """The DiT as one original-layout file (ComfyUI's names: q, k, v fused into attention.qkv)."""
    write_safetensors(layout.to_original(transformer.state_dict()), path, metadata or {}, dtype=dtype)
    return path


def write_diffusers_folder(parts: dict, out_dir: str) -> str:
    """A diffusers ZImagePipeline folder of `parts` (model_index.json, transformer/, vae/, text_encoder/,
    tokenizer/, scheduler/ with Tongyi-MAI's scheduler config), by the libraries' own save_pretrained."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=parts["vae"], text_encoder=parts["text_encoder"],
                          tokenizer=parts["tokenizer"], transformer=parts["transformer"])
    pipe.save_pretrained(out_dir)
    return out_dir


def write_zimage_preset(name: str, out_dir: str) -> dict[str, str]:
    """A preset written as the files users have: the diffusers folder (`diffusers/`), and ComfyUI's single files:
    the DiT (zimage-tiny.safetensors, original names), qwen_3_4b.safetensors (`model.*` keys) and ae.safetensors
    (BFL's LDM names). Returns {"diffusers", "dit", "qwen3", "ae"}."""
    parts = build_zimage_modules(name)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"diffusers": os.path.join(out_dir, "diffusers"),
             "dit": os.path.join(out_dir, "zimage-tiny.safetensors"),
             "qwen3": os.path.join(out_dir, "qwen_3_4b.safetensors"),
             "ae": os.path.join(out_dir, "ae.safetensors")}
    write_diffusers_folder(parts, paths["diffusers"])
    write_dit_file(parts["transformer"], paths["dit"])
    write_safetensors({"model." + k: v for k, v in parts["text_encoder"].state_dict().items()}, paths["qwen3"])
    write_safetensors(ae_file_tensors(parts["vae"].state_dict()), paths["ae"])
    return paths
