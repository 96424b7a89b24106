"""Flags that choose and load the base model (sd-scripts names) and their typed forms."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from library.cli.noise_loss import noise_schedule_from_args, prediction_type_from_args
from library.cli.options import add_flags, at_least, flag, flag_specs, settings_from
from library.core.errors import ConfigError
from library.families.base import LoadOptions
from library.train.settings import TextEncodingOptions

_PRECISION_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class ModelFlags:
    flag_group: ClassVar[str] = "model"
    pretrained_model_name_or_path: Optional[str] = flag(
        None, "base model: a diffusers folder, a .safetensors/.ckpt checkpoint, a Hugging Face id already in the local "
              "cache, or a built-in preset such as tiny:sd1")
    vae: Optional[str] = flag(None, "VAE to use instead of the model's own: a diffusers VAE folder or a "
                                    ".safetensors/.ckpt file")
    v2: bool = flag(False, "the base model is Stable Diffusion 2.x (detected from the model; kept for compatibility)")
    v_parameterization: bool = flag(False, "train with v-prediction (SD 2.x 768-v models); the weights cannot tell, so "
                                           "set it yourself (the same setting as --prediction_type v_prediction)")
    clip_skip: Optional[int] = flag(
        None, "use the output of the n-th text encoder layer from the end (2 = penultimate)",
        range=at_least(1, "checked against the encoder's layer count when the model loads"))
    max_token_length: Optional[int] = flag(None, "maximum caption length in tokens: 150 or 225 encode 75-token chunks "
                                                 "(default: 75, one chunk)", choices=(75, 150, 225))
    weighted_captions: bool = flag(False, "read '(word:1.2)', '(word)', '[word]' in training captions as prompt "
                                          "weights (SD 1.x/2.x, SDXL; not with --cache_text_encoder_outputs)")
    no_half_vae: bool = flag(False, "keep the VAE in float32 under fp16/bf16 mixed precision (avoids NaN latents)")
    tokenizer_cache_dir: Optional[str] = flag(None, "folder holding a saved copy of the tokenizer (for single-file "
                                                    "models without one)")
    from_scratch: bool = flag(False, "build the UNet / transformer from the model's config with random weights drawn "
                                     "from --seed instead of loading its weights (the VAE and text encoders are still "
                                     "loaded)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --pretrained_model_name_or_path, --vae, --v2, --v_parameterization, --clip_skip, ... to `parser`."""
    add_flags(parser, flag_specs(ModelFlags))


def text_options_from_args(ns: argparse.Namespace) -> TextEncodingOptions:
    """--clip_skip / --max_token_length (75: one chunk, the same as unset)."""
    return TextEncodingOptions(clip_skip=ns.clip_skip, max_token_length=None if ns.max_token_length == 75
                               else ns.max_token_length, weighted_captions=ns.weighted_captions)


def load_options_from_args(ns: argparse.Namespace, family_options: Any = None,
                           seed: Optional[int] = None) -> LoadOptions:
    """The LoadOptions a family needs, from the model flags (and --mixed_precision for dtypes).

    Frozen base weights are held in the mixed-precision dtype, as in sd-scripts; the
    VAE follows it unless --no_half_vae keeps it in float32. `seed`: the run's seed (drawn
    when --seed is not given), else the flag (else 0); --from_scratch initialises with it.
    """
    if not ns.pretrained_model_name_or_path:
        raise ConfigError("--pretrained_model_name_or_path: required (a model folder, checkpoint file or preset)")
    dtype = _PRECISION_DTYPES[getattr(ns, "mixed_precision", None) or "no"]  # a choice of the training flags
    return settings_from(
        LoadOptions, ns,
        v_parameterization=prediction_type_from_args(ns) == "v_prediction",
        noise_schedule=noise_schedule_from_args(ns),
        dtype=dtype,
        vae_dtype=torch.float32 if ns.no_half_vae else dtype,
        family_options=family_options,
        init_seed=seed if seed is not None else (getattr(ns, "seed", None) or 0),
    )
