"""Load FLUX.1 from what --pretrained_model_name_or_path names: a preset or a diffusers folder.

Nothing is downloaded. The BFL single-file layout (`flux1-dev.safetensors` with
separate --clip_l / --t5xxl / --ae files) is recognised and refused with a
clear message until its converter lands (see docs/flux_train_network.md).
"""

from __future__ import annotations

import os

from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.flux_configs import PRESETS, build_flux_modules
from library.families.loading import SINGLE_FILE_SUFFIXES

_PARTS = ("transformer", "vae", "text_encoder", "text_encoder_2")


def flux_source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file"; ModelLoadError naming the problem otherwise."""
    if path in PRESETS:
        return "preset"
    if path.startswith(("tiny:", "random:")):
        raise ModelLoadError(f"--pretrained_model_name_or_path: unknown FLUX.1 preset {path!r}; "
                             f"expected one of {', '.join(PRESETS)}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise ModelLoadError(f"{path}: not a diffusers model folder (no model_index.json)")
        missing = [p for p in _PARTS if not os.path.isdir(os.path.join(path, p))]
        if missing:
            raise ModelLoadError(f"{path}: not a FLUX.1 diffusers folder (no {missing[0]}/); "
                                 "expected transformer/, vae/, text_encoder/ and text_encoder_2/")
        return "diffusers"
    if os.path.isfile(path):
        if not path.lower().endswith(SINGLE_FILE_SUFFIXES):
            raise ModelLoadError(f"{path}: expected a .safetensors FLUX.1 checkpoint or a diffusers folder")
        return "single_file"
    raise ModelLoadError(f"--pretrained_model_name_or_path: {path} does not exist (FLUX.1 needs a local "
                         "diffusers folder or a preset such as tiny:flux)")


def _diffusers_parts(folder: str) -> dict:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    try:
        parts = {
            "transformer": FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer"),
            "vae": AutoencoderKL.from_pretrained(folder, subfolder="vae"),
            "text_encoder": CLIPTextModel.from_pretrained(folder, subfolder="text_encoder"),
            "text_encoder_2": T5EncoderModel.from_pretrained(folder, subfolder="text_encoder_2"),
            "tokenizer": CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer"),
            "tokenizer_2": T5TokenizerFast.from_pretrained(folder, subfolder="tokenizer_2"),
        }
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{folder}: cannot load the FLUX.1 diffusers model "
                             f"({str(e).strip().splitlines()[0][:200]})") from None
    for key in _PARTS:
        parts[key].eval()
    return parts


def load_flux_components(opts: LoadOptions) -> Components:
    """Components of a FLUX.1 model: denoiser = transformer, text encoders = [CLIP-L, T5]."""
    path = opts.pretrained_model_name_or_path
    kind = flux_source_kind(path)
    if kind == "single_file":
        raise ModelLoadError(f"{path}: loading the BFL single-file layout (flux1-dev.safetensors with --clip_l, "
                             "--t5xxl, --ae) is not implemented yet; convert it to a diffusers folder first")
    parts = build_flux_modules(path) if kind == "preset" else _diffusers_parts(path)
    if opts.vae:
        from library.families.loading import load_vae

        parts["vae"] = load_vae(opts.vae)
    for key, dtype in (("transformer", opts.dtype), ("text_encoder", opts.dtype), ("text_encoder_2", opts.dtype),
                       ("vae", opts.vae_dtype)):
        if parts[key].dtype != dtype:
            parts[key].to(dtype=dtype)
    return Components(denoiser=parts["transformer"], vae=parts["vae"],
                      text_encoders=[parts["text_encoder"], parts["text_encoder_2"]],
                      tokenizers=[parts["tokenizer"], parts["tokenizer_2"]], model_path=path, vae_path=opts.vae)
