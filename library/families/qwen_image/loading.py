"""Load Qwen-Image from the files users have, and write the tiny preset in the same layouts.

- a diffusers folder (Qwen/Qwen-Image: transformer/, vae/, text_encoder/ = Qwen2_5_VLForConditionalGeneration,
  tokenizer/), as QwenImagePipeline.from_pretrained reads it;
- ComfyUI's single files: the DiT (qwen_image_bf16.safetensors, diffusers names, `model.diffusion_model.` accepted;
  or a ComfyUI-GGUF file of it, qwen-image-Q8_0.gguf, `general.architecture` "qwen_image", its quantized weights kept)
  with --text_encoder (qwen_2.5_vl_7b.safetensors: `model.*` language-model keys; `visual.*` / `lm_head` unused, or
  a transformers folder) and --vae (ComfyUI's qwen_image_vae.safetensors in Wan 2.1 names, or the diffusers VAE
  file vae/diffusion_pytorch_model.safetensors as musubi-tuner takes it; told apart by their keys, or a VAE folder);
- tokenizer: the tiny one for the tiny encoder, else Qwen/Qwen2.5-VL-7B-Instruct's from the folder,
  --tokenizer_cache_dir or the local HF cache.

Qwen-Image-Edit (--model_version edit*) loads Qwen2.5-VL with its vision tower (the file's `visual.*`, or the whole
folder model) and wraps the tokenizer in Qwen2VLProcessor (a folder's processor/ gives the image processor's
settings); 2511's zero_cond_t is set on the DiT. tiny:qwen_image_edit is written as Qwen/Qwen-Image-Edit-2509's
folder (model_index QwenImageEditPlusPipeline, processor/) or the three ComfyUI-style files with `visual.*`.

Configurations are read from tensor shapes; models are built on the meta device and adopt the tensors.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from library.core.safetensors_io import write_safetensors
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.gguf_file import (
    GGUF_SUFFIX,
    adopt_gguf,
    gguf_keys,
    is_gguf,
    logical_shape,
)
from library.families.common.qwen_vl import load_qwen_vl, vl_processor
from library.families.common.dit_layout import COMFY_PREFIX, count_blocks
from library.families.common.loading import adopt, classify_source, read_dit_file
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.common.wan_vae import read_vae_tensors, to_wan
from library.families.qwen_image.configs import (
    LATENT_CHANNELS,
    PATCH,
    PRESETS,
    build_qwen_image_modules,
    vae_config,
)
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

FOLDER_PARTS = ("transformer", "vae", "text_encoder", "tokenizer")
# ComfyUI's Qwen-Image-Edit-2511 files (and GGUF files made from them) hold this empty tensor: the reference images
# are modulated at t = 0 (diffusers' zero_cond_t, set by --model_version edit-2511); the loaders leave it out
EDIT_2511_MARKER = "__index_timestep_zero__"
_DIT_MARKER = re.compile(r"^(model\.diffusion_model\.)?transformer_blocks\.0\.img_mod\.1\.weight$")


def source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file" (a ModelLoadError naming the problem otherwise)."""
    return classify_source(path, PRESETS, "Qwen-Image", folder_parts=FOLDER_PARTS,
                           file_suffixes=(".safetensors", GGUF_SUFFIX), gguf=True,
                           expected="a Qwen-Image DiT .safetensors or ComfyUI-GGUF .gguf file, a diffusers folder, "
                                    "tiny:qwen_image or tiny:qwen_image_edit")


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes (frame, height, width) of a head width (not stored in the file): Qwen-Image's (16, 56, 56) for
    128, the tiny preset's (4, 6, 6) for 16."""
    if head_dim == 128:
        return 16, 56, 56
    rest = (head_dim - head_dim // 4) // 2
    return head_dim // 4, rest, rest


def load_dit_file(path: str, dtype: torch.dtype, label: str = "--pretrained_model_name_or_path"):
    """QwenImageTransformer2DModel from a single DiT file (Qwen's / ComfyUI's names), or a ComfyUI-GGUF file of it
    (city96's / QuantStack's Qwen-Image and Qwen-Image-Edit files: `general.architecture` "qwen_image", the same
    names; quantized weights kept). The config is read from the logical shapes."""
    QwenImageTransformer2DModel = diffusers_class("QwenImageTransformer2DModel")

    def dit_config(tensors):
        # logical shapes: a GGUF-quantized tensor's own shape is its byte shape (rows, bytes per row)
        hidden, inputs = logical_shape(tensors["img_in.weight"])
        head_dim = logical_shape(tensors["transformer_blocks.0.attn.norm_q.weight"])[0]
        return dict(patch_size=PATCH, in_channels=inputs,
                    out_channels=logical_shape(tensors["proj_out.weight"])[0] // 4,
                    num_layers=count_blocks(tensors, "transformer_blocks"), attention_head_dim=head_dim,
                    num_attention_heads=hidden // head_dim,
                    joint_attention_dim=logical_shape(tensors["txt_in.weight"])[1], guidance_embeds=False,
                    axes_dims_rope=rope_axes(head_dim))

    gguf = is_gguf(path)
    tensors, config = read_dit_file(label, path, dtype, expected="a Qwen-Image DiT (transformer_blocks.*.img_mod keys)",
                                    marker=_DIT_MARKER, infer_shape=dit_config, what="Qwen-Image DiT",
                                    gguf_archs=("qwen_image",))
    inputs = config["in_channels"]
    if inputs != LATENT_CHANNELS * PATCH * PATCH:
        raise ModelLoadError(f"{label} {path}: expected the Qwen-Image DiT ({LATENT_CHANNELS * 4} img_in inputs), "
                             f"found {inputs}")
    return (adopt_gguf if gguf else adopt)(label, path, lambda: QwenImageTransformer2DModel(**config), tensors)


def load_vae_file(path: str, dtype: torch.dtype, label: str = "--vae"):
    """AutoencoderKLQwenImage from a VAE folder or one file: ComfyUI's qwen_image_vae.safetensors (Wan 2.1 names) or
    the diffusers file (vae/diffusion_pytorch_model.safetensors), told apart by the keys (common/wan_vae.py)."""
    AutoencoderKLQwenImage = diffusers_class("AutoencoderKLQwenImage")

    if os.path.isdir(path):
        try:
            return AutoencoderKLQwenImage.from_pretrained(path, torch_dtype=dtype).eval()
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{label} {path}: not a Qwen-Image VAE folder ({str(e).splitlines()[0][:200]})") from None
    tensors = read_vae_tensors(label, path, dtype)
    try:
        base = tensors["encoder.conv_in.weight"].shape[0]
        levels = len({m[1] for k in tensors if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k))})
        res = len({m[1] for k in tensors if (m := re.match(r"decoder\.up_blocks\.0\.resnets\.(\d+)\.", k))}) - 1
        z = tensors["post_quant_conv.weight"].shape[0]
        mult = _vae_mult(tensors, base, res, levels)
    except KeyError as e:
        raise ModelLoadError(f"{label} {path}: incomplete Qwen-Image VAE, no tensor for {e.args[0]}") from None
    if z != LATENT_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected a VAE with {LATENT_CHANNELS} latent channels, found {z}")
    return adopt(label, path, lambda: AutoencoderKLQwenImage(**vae_config(base, tuple(mult), res)), tensors)


def _vae_mult(tensors, base: int, res: int, levels: int) -> list[int]:
    """dim_mult: each encoder level's resnet output width over base_dim (diffusers lists every level's resnets and
    its resampler in one down_blocks list)."""
    out, index = [], 0
    for level in range(levels):
        out.append(tensors[f"encoder.down_blocks.{index}.conv2.weight"].shape[0] // base)
        index += res + (1 if level < levels - 1 else 0)
    return out


def load_components(opts: LoadOptions, options) -> Components:
    """Components: denoiser = QwenImageTransformer2DModel, text encoders = [Qwen2.5-VL text model],
    tokenizers = [Qwen's], vae = AutoencoderKLQwenImage (`options`: QwenImageOptions)."""
    AutoencoderKLQwenImage, QwenImageTransformer2DModel = diffusers_classes(
        "AutoencoderKLQwenImage", "QwenImageTransformer2DModel")

    path = opts.pretrained_model_name_or_path
    kind = source_kind(path)
    vae = None
    edit = options.is_edit  # Qwen-Image-Edit: Qwen2.5-VL with its vision tower, Qwen2VLProcessor as the "tokenizer"
    if kind == "single_file":
        check_model_source(path, options, opts.vae, need_vae=False)
        transformer = load_dit_file(path, opts.dtype)
        qwen, tokenizer = load_qwen_vl(options.text_encoder, opts.dtype, opts.tokenizer_cache_dir, vision=edit)
    elif kind == "diffusers":
        try:
            transformer = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer",
                                                                      torch_dtype=opts.dtype).eval()
            vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", torch_dtype=opts.vae_dtype).eval()
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: unreadable Qwen-Image folder ({str(e).splitlines()[0][:200]})") from None
        qwen, tokenizer = load_qwen_vl(options.text_encoder or os.path.join(path, "text_encoder"), opts.dtype,
                                       opts.tokenizer_cache_dir, vision=edit)
        if not options.text_encoder:
            from transformers import AutoTokenizer

            # Qwen-Image-Edit folders hold processor/ (the tokenizer with the image processor's settings)
            sub = "processor" if edit and os.path.isdir(os.path.join(path, "processor")) else "tokenizer"
            tokenizer = AutoTokenizer.from_pretrained(os.path.join(path, sub))
            tokenizer.padding_side = "right"
    else:
        parts = build_qwen_image_modules(path)
        transformer, vae, qwen, tokenizer = parts["transformer"], parts["vae"], parts["qwen"], parts["qwen_tokenizer"]
        if edit and not PRESETS[path].vision and not options.text_encoder:
            raise ModelLoadError(f"--model_version {options.version}: {path} has no vision tower; use "
                                 f"tiny:qwen_image_edit")
        if not edit and PRESETS[path].vision:
            qwen = qwen.language_model
        if options.text_encoder:
            qwen, tokenizer = load_qwen_vl(options.text_encoder, opts.dtype, opts.tokenizer_cache_dir, vision=edit)
    if opts.vae:
        vae = load_vae_file(opts.vae, opts.vae_dtype)
    if edit:
        tokenizer = vl_processor(tokenizer, _folder_image_processor(path) if kind == "diffusers" else None)
    if options.version == "edit-2511" and not transformer.config.get("zero_cond_t", False):
        set_zero_cond_t(transformer)
    if opts.from_scratch:
        from library.families.common.loading import scratch_denoiser

        transformer = scratch_denoiser(transformer, opts.init_seed)
    for module, dtype in ((transformer, opts.dtype), (qwen, opts.dtype), (vae, opts.vae_dtype)):
        if module is not None and next(module.parameters()).dtype != dtype:
            module.to(dtype=dtype)
    return Components(denoiser=transformer, vae=vae, text_encoders=[qwen], tokenizers=[tokenizer],
                      model_path=path, vae_path=opts.vae)


def set_zero_cond_t(transformer) -> None:
    """Qwen-Image-Edit-2511's DiT (transformer/config.json zero_cond_t: true; not in a single file): the reference
    tokens are modulated at t = 0. Same weights, a config switch of diffusers' model and its blocks."""
    transformer.register_to_config(zero_cond_t=True)
    transformer.zero_cond_t = True
    for block in transformer.transformer_blocks:
        block.zero_cond_t = True


def _folder_image_processor(path: str):
    """The image processor of a Qwen-Image-Edit folder's processor/ (Qwen2.5-VL's defaults when it has none)."""
    folder = os.path.join(path, "processor")
    if not os.path.isfile(os.path.join(folder, "preprocessor_config.json")):
        return None
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor.from_pretrained(folder)


def check_model_source(path: str, options, vae: Optional[str], need_vae: bool = True) -> None:
    """The checks of load_components that need no weights (one-line ModelLoadError)."""
    if source_kind(path) == "single_file":
        for flag, value in (("text_encoder", options.text_encoder), ("vae", vae if need_vae else "given")):
            if not value:
                raise ModelLoadError(f"--{flag}: required with a Qwen-Image DiT file ({path})")
        if options.version != "edit-2511" and EDIT_2511_MARKER in _dit_file_keys(path):  # as musubi-tuner asserts
            raise ModelLoadError(f"--model_version {options.version}: {path} is a Qwen-Image-Edit-2511 DiT (it holds "
                                 f"ComfyUI's {EDIT_2511_MARKER} marker); give --model_version edit-2511")



def _dit_file_keys(path: str) -> list[str]:
    """A DiT file's tensor names (ComfyUI's prefix dropped), read from its header; [] when unreadable (the loader
    names the problem)."""
    try:
        if is_gguf(path):
            return gguf_keys(path)
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return [k[len(COMFY_PREFIX):] if k.startswith(COMFY_PREFIX) else k for k in f.keys()]
    except Exception:  # noqa: BLE001 - an unreadable header: load_dit_file names it in one line
        return []


def block_count(path: str) -> Optional[int]:
    """Blocks of a preset, folder or DiT file, read without loading weights; None when it cannot tell."""
    try:
        kind = source_kind(path)
        if kind == "preset":
            return PRESETS[path].layers
        if kind == "diffusers":
            with open(os.path.join(path, "transformer", "config.json"), encoding="utf-8") as f:
                return int(json.load(f)["num_layers"])
        if is_gguf(path):
            return len({m[1] for k in gguf_keys(path) if (m := re.match(r"transformer_blocks\.(\d+)\.", k))}) or None
        return indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?transformer_blocks\.(\d+)\.") or None
    except (OSError, ValueError, KeyError, ModelLoadError):
        return None


# --- writing -------------------------------------------------------------------------------------------------------

def _tiny_vl_config(qwen):
    """A Qwen2.5-VL config around `qwen`'s text config with a tiny vision tower (the folder holds the whole model)."""
    from transformers import Qwen2_5_VLConfig

    text = qwen.config.to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=qwen.config.hidden_size,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision)


def write_qwen_image_preset(name: str, out_dir: str, single_file: bool) -> dict[str, str]:
    """A preset written as the files users have.

    single_file: ComfyUI's split files, {"dit": qwen_image_tiny.safetensors (diffusers names),
    "text_encoder": qwen_2.5_vl_7b.safetensors (`model.*` + `lm_head.weight`), "vae": qwen_image_vae.safetensors
    in Wan 2.1 names as ComfyUI's};
    else a diffusers folder as Qwen/Qwen-Image ({"folder"}).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLForConditionalGeneration

    parts = build_qwen_image_modules(name)
    vision = PRESETS[name].vision  # tiny:qwen_image_edit: the whole Qwen2.5-VL (vision tower too) and processor/
    language = parts["qwen"].language_model if vision else parts["qwen"]
    os.makedirs(out_dir, exist_ok=True)
    if single_file:
        paths = {"dit": os.path.join(out_dir, "qwen_image_tiny.safetensors"),
                 "text_encoder": os.path.join(out_dir, "qwen_2.5_vl_7b.safetensors"),
                 "vae": os.path.join(out_dir, "qwen_image_vae.safetensors")}
        write_safetensors(parts["transformer"].state_dict(), paths["dit"])
        qwen = {"model." + k: v for k, v in language.state_dict().items()}
        if vision:  # ComfyUI's qwen_2.5_vl_7b.safetensors keeps the vision tower as visual.*
            qwen.update({"visual." + k: v for k, v in parts["qwen"].visual.state_dict().items()})
        qwen["lm_head.weight"] = language.embed_tokens.weight.detach().clone()
        write_safetensors(qwen, paths["text_encoder"])
        write_safetensors(to_wan(parts["vae"].state_dict()), paths["vae"])  # ComfyUI's Wan 2.1 names
        return paths
    tmp = out_dir.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    parts["transformer"].save_pretrained(os.path.join(tmp, "transformer"))
    parts["vae"].save_pretrained(os.path.join(tmp, "vae"))
    if vision:
        whole = Qwen2_5_VLForConditionalGeneration(parts["qwen"].config)
        whole.model.load_state_dict(parts["qwen"].state_dict())
    else:
        whole = Qwen2_5_VLForConditionalGeneration(_tiny_vl_config(parts["qwen"]))
        whole.model.language_model.load_state_dict(parts["qwen"].state_dict())
    whole.save_pretrained(os.path.join(tmp, "text_encoder"))
    parts["qwen_tokenizer"].save_pretrained(os.path.join(tmp, "tokenizer"))
    if vision:  # Qwen/Qwen-Image-Edit-2509 processor/: the tokenizer and the image processor's settings
        parts["qwen_tokenizer"].save_pretrained(os.path.join(tmp, "processor"))
        parts["qwen_processor"].image_processor.save_pretrained(os.path.join(tmp, "processor"))
    FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image scheduler/scheduler_config.json
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, num_train_timesteps=1000,
        shift=1.0, shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True,
    ).save_pretrained(os.path.join(tmp, "scheduler"))
    index = {"_class_name": "QwenImageEditPlusPipeline" if vision else "QwenImagePipeline",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "tokenizer": ["transformers", type(parts["qwen_tokenizer"]).__name__],
             "transformer": ["diffusers", "QwenImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    if vision:
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    with open(os.path.join(tmp, "model_index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)
    return {"folder": out_dir}
