"""Chroma (lodestones' FLUX.1-schnell derivative): its transformer configurations, presets, single-file layout and loading.

Chroma is FLUX.1's transformer without CLIP-L and without the per-block modulation layers: one
"distilled guidance layer" (an MLP approximator) turns the timestep into every block's
modulation vectors. diffusers' ChromaTransformer2DModel is the model; the single file
(`Chroma.safetensors`, as sd-scripts' `flux_train_network.py --model_type chroma` reads it) uses
BFL's names: the blocks as FLUX.1's (fused qkv / linear1, RMSNorm `.scale`), `img_in`, `txt_in`,
`final_layer.linear` and `distilled_guidance_layer.{in_proj, layers.N.in_layer / out_layer,
norms.N.scale, out_proj}`. The T5-XXL encoder and the AE are FLUX.1's.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

import torch
from torch import nn

from library.families.flux import layout as bfl
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.chroma.configs import APPROXIMATOR_CHANNELS, PRESET_SEED, PRESETS, ChromaPreset
from library.families.common.autoencoder import LATENT_CHANNELS
from library.families.common.autoencoder import flux_vae_config
from library.families.common.t5 import build_t5_tokenizer, t5_config
from library.families.flux.configs import PRESET_SEED as FLUX_SEED
from library.families.flux.configs import PRESETS as FLUX_PRESETS
from library.families.common.autoencoder import load_ae_file
from library.families.common.t5 import load_t5xxl_file
from library.families.common.loading import adopt, read_file
from library.families.common.loading import classify_source, load_vae, scratch_denoiser
from library.families.common.tiny import build_seeded
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

CHROMA_IMPLEMENTATION = "https://huggingface.co/lodestones/Chroma"  # sd-scripts' modelspec.implementation




def transformer_config(p: ChromaPreset, joint_attention_dim: int) -> dict:
    """Keyword arguments of diffusers' ChromaTransformer2DModel for a preset."""
    return dict(patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=p.double_blocks,
                num_single_layers=p.single_blocks, attention_head_dim=p.head_dim, num_attention_heads=p.heads,
                joint_attention_dim=joint_attention_dim, axes_dims_rope=tuple(p.axes_dims_rope),
                approximator_num_channels=APPROXIMATOR_CHANNELS, approximator_hidden_dim=p.approximator_hidden,
                approximator_layers=p.approximator_layers)


def build_chroma_modules(name: str, device: str | torch.device = "cpu") -> dict:
    """Transformer, AE, T5 and its tokenizer of a preset: {"transformer", "vae", "text_encoder", "tokenizer"}.

    The AE and T5 are the FLUX.1 preset's (the same files serve both models); on "meta" nothing is allocated.
    """
    AutoencoderKL, ChromaTransformer2DModel = diffusers_classes("AutoencoderKL", "ChromaTransformer2DModel")
    from transformers import T5EncoderModel

    p = PRESETS[name]
    flux = FLUX_PRESETS[p.flux_preset]
    tokenizer = build_t5_tokenizer()
    t5_cfg = t5_config(flux, flux.t5_vocab or len(tokenizer))
    # The same seeds as the FLUX.1 preset's AE and T5: the same weights, so one set of files serves both.
    parts = {
        "transformer": build_seeded(lambda: ChromaTransformer2DModel(**transformer_config(p, flux.t5_d_model)),
                                    PRESET_SEED, device),
        "vae": build_seeded(lambda: AutoencoderKL(**flux_vae_config(flux.vae_channels)), FLUX_SEED + 1, device),
        "text_encoder": build_seeded(lambda: T5EncoderModel(t5_cfg), FLUX_SEED + 3, device),
    }
    for module in parts.values():
        module.eval()
    return {**parts, "tokenizer": tokenizer}


# --- the single-file layout ------------------------------------------------------------------------
_APPROXIMATOR = re.compile(r"^distilled_guidance_layer\.(layers\.\d+\.linear_[12]|norms\.\d+)\.(weight|bias)$")
_APPROXIMATOR_NAMES = {"linear_1": "in_layer", "linear_2": "out_layer"}


def chroma_to_single_file(state_dict: Mapping[str, torch.Tensor], lazy: bool = False) -> dict[str, Any]:
    """A ChromaTransformer2DModel state dict in the single-file (BFL) layout; the blocks and embedders as FLUX.1's.

    With `lazy`, fused tensors are Deferred (made when written)."""
    out: dict[str, Any] = {}
    rest = {}
    for key, tensor in state_dict.items():
        if key.startswith("distilled_guidance_layer."):
            m = _APPROXIMATOR.match(key)
            if m and m[1].startswith("norms."):
                out[f"distilled_guidance_layer.{m[1]}.scale"] = tensor
            elif m:
                layer, linear = m[1].rsplit(".", 1)
                out[f"distilled_guidance_layer.{layer}.{_APPROXIMATOR_NAMES[linear]}.{m[2]}"] = tensor
            else:  # in_proj / out_proj keep their names
                out[key] = tensor
        else:
            rest[key] = tensor
    out.update(bfl.diffusers_to_bfl(rest, lazy=lazy))
    return out


_APPROXIMATOR_FILE = re.compile(r"^distilled_guidance_layer\.(layers\.\d+)\.(in_layer|out_layer)\.(weight|bias)$")
_APPROXIMATOR_NORM_FILE = re.compile(r"^distilled_guidance_layer\.(norms\.\d+)\.scale$")
_LINEAR_NAMES = {v: k for k, v in _APPROXIMATOR_NAMES.items()}


def chroma_from_single_file(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The single file's tensors (prefix optional) as ChromaTransformer2DModel's state dict; the inverse of
    chroma_to_single_file (fused tensors split into views). BflLayoutError on a stray key.

    diffusers' own converter (convert_chroma_transformer_checkpoint_to_diffusers) reads the same names but only
    at Chroma's full width (3072); this reads any size, and a test checks both agree on the full-size model."""
    out: dict[str, torch.Tensor] = {}
    rest = {}
    for key, tensor in bfl.upcast_float8(bfl.transformer_tensors(checkpoint)).items():
        linear, norm = _APPROXIMATOR_FILE.match(key), _APPROXIMATOR_NORM_FILE.match(key)
        if linear:
            out[f"distilled_guidance_layer.{linear[1]}.{_LINEAR_NAMES[linear[2]]}.{linear[3]}"] = tensor
        elif norm:
            out[f"distilled_guidance_layer.{norm[1]}.weight"] = tensor
        elif key.startswith("distilled_guidance_layer.") and key.split(".")[1] in ("in_proj", "out_proj"):
            out[key] = tensor
        else:
            rest[key] = tensor
    out.update(bfl.bfl_to_diffusers(rest))
    return out


def infer_chroma_config(checkpoint: Mapping[str, torch.Tensor]) -> dict:
    """ChromaTransformer2DModel kwargs from the single file's tensor names and shapes (the rotary axes from the
    preset of the same head size, as for FLUX.1)."""
    try:
        inner, in_channels = checkpoint["img_in.weight"].shape
        head_dim = checkpoint["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
        joint_dim = checkpoint["txt_in.weight"].shape[1]
        approx_hidden, approx_in = checkpoint["distilled_guidance_layer.in_proj.weight"].shape
    except KeyError as e:
        raise bfl.BflLayoutError(f"missing tensor {e.args[0]} of a Chroma transformer") from None
    axes = next((p.axes_dims_rope for p in PRESETS.values() if p.head_dim == head_dim), None)
    if axes is None or inner % head_dim:
        raise bfl.BflLayoutError(f"unsupported attention head size {head_dim} (hidden size {inner})")
    layers = len({k.split(".")[2] for k in checkpoint if k.startswith("distilled_guidance_layer.layers.")})
    return dict(patch_size=1, in_channels=in_channels, num_layers=bfl.block_count(checkpoint, "double_blocks"),
                num_single_layers=bfl.block_count(checkpoint, "single_blocks"), attention_head_dim=head_dim,
                num_attention_heads=inner // head_dim, joint_attention_dim=joint_dim, axes_dims_rope=tuple(axes),
                approximator_num_channels=approx_in, approximator_hidden_dim=approx_hidden,
                approximator_layers=layers)


def is_chroma_checkpoint(keys) -> bool:
    """A Chroma transformer file: FLUX.1 blocks and the distilled guidance layer."""
    return any(k.startswith(("distilled_guidance_layer.", bfl.BFL_PREFIX + "distilled_guidance_layer.")) for k in keys)


def load_chroma_transformer(path: str, dtype: torch.dtype = torch.float32,
                            label: str = "--pretrained_model_name_or_path"):
    """ChromaTransformer2DModel from a Chroma single file (Chroma1-HD / -Base layout, any precision)."""
    ChromaTransformer2DModel = diffusers_class("ChromaTransformer2DModel")

    tensors = read_file(label, path, "a Chroma transformer (double_blocks.* and distilled_guidance_layer.* keys)",
                         is_chroma_checkpoint, dtype)
    tensors = bfl.transformer_tensors(tensors)
    try:
        config = infer_chroma_config(tensors)
        state_dict = chroma_from_single_file(tensors)
    except bfl.BflLayoutError as e:
        raise ModelLoadError(f"{label} {path}: {e}") from None
    return adopt(label, path, lambda: ChromaTransformer2DModel(**config), state_dict)


def chroma_block_counts(path: str) -> Optional[tuple[int, int]]:
    """(double, single) blocks of a preset or single file, without reading weights; None when unknown."""
    if path in PRESETS:
        return PRESETS[path].double_blocks, PRESETS[path].single_blocks
    try:
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            keys = list(bfl.transformer_tensors(dict.fromkeys(f.keys())))
        return bfl.block_count(keys, "double_blocks"), bfl.block_count(keys, "single_blocks")
    except (OSError, ValueError):
        return None


def chroma_source_kind(path: str) -> str:
    """"preset" or "single_file"; a one-line ModelLoadError otherwise (no diffusers folders, as sd-scripts)."""
    kind = classify_source(path, PRESETS, "Chroma", file_suffixes=(".safetensors",),
                           expected="a Chroma .safetensors file (with --t5xxl and --ae) or a preset such as "
                                    "tiny:chroma")
    if kind != "preset" and kind != "single_file":
        raise ModelLoadError(f"--pretrained_model_name_or_path {path}: Chroma loads a single .safetensors file "
                             "(as sd-scripts); diffusers folders are not supported")
    return kind


def load_chroma_components(opts: LoadOptions, t5xxl: Optional[str], ae: Optional[str]) -> Components:
    """Components of a Chroma model: denoiser = transformer, text encoders = [T5] (no CLIP-L)."""
    path = opts.pretrained_model_name_or_path
    if chroma_source_kind(path) == "single_file":
        for flag, value, what in (("t5xxl", t5xxl, "the T5-XXL encoder file"), ("ae", ae, "the FLUX.1 ae file")):
            if not value:
                raise ModelLoadError(f"--{flag}: required with a Chroma single-file transformer ({path}); give {what}")
        parts = {"transformer": load_chroma_transformer(path, opts.dtype)}
    else:
        parts = build_chroma_modules(path)
    if t5xxl:
        parts["text_encoder"], parts["tokenizer"] = load_t5xxl_file(t5xxl, opts.dtype, opts.tokenizer_cache_dir)
    if ae:
        parts["vae"] = load_ae_file(ae, opts.vae_dtype)
    if opts.from_scratch:
        parts["transformer"] = scratch_denoiser(parts["transformer"], opts.init_seed)
    if opts.vae:
        parts["vae"] = load_vae(opts.vae)
    for key, dtype in (("transformer", opts.dtype), ("text_encoder", opts.dtype), ("vae", opts.vae_dtype)):
        module: nn.Module = parts[key]
        if module.dtype != dtype:
            module.to(dtype=dtype)
    return Components(denoiser=parts["transformer"], vae=parts["vae"], text_encoders=[parts["text_encoder"]],
                      tokenizers=[parts["tokenizer"]], model_path=path, vae_path=opts.vae)


def write_chroma_preset(preset: str, out: str) -> dict[str, str]:
    """Write a preset ("tiny:chroma") as a Chroma user has it: the transformer single file (`out`, a .safetensors
    name, or a folder that gets chroma-tiny.safetensors) plus t5xxl.safetensors and ae.safetensors next to it.
    Returns {"transformer" | "t5xxl" | "ae": path}."""
    from library.families.common import ldm_layout as ldm
    from library.families import model_saving
    from library.families.common.t5 import t5_to_file

    parts = build_chroma_modules(preset)
    transformer = out if out.lower().endswith(".safetensors") else os.path.join(out, "chroma-tiny.safetensors")
    folder = os.path.dirname(os.path.abspath(transformer))
    os.makedirs(folder, exist_ok=True)
    vae_state = parts["vae"].state_dict()
    files = {"transformer": (transformer, chroma_to_single_file(parts["transformer"].state_dict(), lazy=True)),
             "t5xxl": (os.path.join(folder, "t5xxl.safetensors"), t5_to_file(parts["text_encoder"].state_dict())),
             "ae": (os.path.join(folder, "ae.safetensors"), ldm.push(vae_state, ldm.vae_key_map(vae_state.keys(), "")))}
    for path, state in files.values():
        model_saving.write_single_file(state, path, "safetensors", metadata=model_saving.SAFETENSORS_METADATA)
    return {name: path for name, (path, _) in files.items()}
