"""Flags that choose and load the base model (sd-scripts names) and their typed forms."""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

from library.cli.noise_loss import noise_schedule_from_args, prediction_type_from_args
from library.core.errors import ConfigError
from library.families.base import LoadOptions
from library.train.settings import TextEncodingOptions

_PRECISION_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --pretrained_model_name_or_path, --vae, --v2, --v_parameterization, --clip_skip, ... to `parser`."""
    g = parser.add_argument_group("model")
    g.add_argument("--pretrained_model_name_or_path", type=str, default=None,
                   help="base model: a diffusers folder, a .safetensors/.ckpt checkpoint, a Hugging Face id "
                        "already in the local cache, or a built-in preset such as tiny:sd1")
    g.add_argument("--vae", type=str, default=None,
                   help="VAE to use instead of the model's own: a diffusers VAE folder or a .safetensors/.ckpt file")
    g.add_argument("--v2", action="store_true",
                   help="the base model is Stable Diffusion 2.x (detected from the model; kept for compatibility)")
    g.add_argument("--v_parameterization", action="store_true",
                   help="train with v-prediction (SD 2.x 768-v models); the weights cannot tell, so set it yourself "
                        "(the same setting as --prediction_type v_prediction)")
    g.add_argument("--clip_skip", type=int, default=None,
                   help="use the output of the n-th text encoder layer from the end (2 = penultimate)")
    g.add_argument("--max_token_length", type=int, default=None, choices=[75, 150, 225],
                   help="maximum caption length in tokens: 150 or 225 encode 75-token chunks "
                        "(default: 75, one chunk)")
    g.add_argument("--no_half_vae", action="store_true",
                   help="keep the VAE in float32 under fp16/bf16 mixed precision (avoids NaN latents)")
    g.add_argument("--tokenizer_cache_dir", type=str, default=None,
                   help="folder holding a saved copy of the tokenizer (for single-file models without one)")
    g.add_argument("--from_scratch", action="store_true",
                   help="build the UNet / transformer from the model's config with random weights drawn from --seed "
                        "instead of loading its weights (the VAE and text encoders are still loaded)")




def text_options_from_args(ns: argparse.Namespace) -> TextEncodingOptions:
    """--clip_skip / --max_token_length, validated."""
    clip_skip = getattr(ns, "clip_skip", None)
    if clip_skip is not None and (not isinstance(clip_skip, int) or clip_skip < 1):
        raise ConfigError(f"--clip_skip: expected an integer >= 1, got {clip_skip!r}")
    max_len = getattr(ns, "max_token_length", None)
    if max_len not in (None, 75, 150, 225):
        raise ConfigError(f"--max_token_length: expected 75, 150 or 225 (or unset), got {max_len!r}")
    return TextEncodingOptions(clip_skip=clip_skip, max_token_length=None if max_len == 75 else max_len)


def load_options_from_args(ns: argparse.Namespace, family_options: Any = None,
                           seed: Optional[int] = None) -> LoadOptions:
    """The LoadOptions a family needs, from the model flags (and --mixed_precision for dtypes).

    Frozen base weights are held in the mixed-precision dtype, as in sd-scripts; the
    VAE follows it unless --no_half_vae keeps it in float32. `seed`: the run's seed (drawn
    when --seed is not given), else the flag (else 0); --from_scratch initialises with it.
    """
    path = getattr(ns, "pretrained_model_name_or_path", None)
    if not path:
        raise ConfigError("--pretrained_model_name_or_path: required (a model folder, checkpoint file or preset)")
    precision = getattr(ns, "mixed_precision", None) or "no"
    if precision not in _PRECISION_DTYPES:
        raise ConfigError(f"--mixed_precision: expected one of no, fp16, bf16, got {precision!r}")
    dtype = _PRECISION_DTYPES[precision]
    return LoadOptions(
        pretrained_model_name_or_path=path,
        vae=getattr(ns, "vae", None),
        v2=bool(getattr(ns, "v2", False)),
        v_parameterization=prediction_type_from_args(ns) == "v_prediction",
        noise_schedule=noise_schedule_from_args(ns),
        dtype=dtype,
        vae_dtype=torch.float32 if getattr(ns, "no_half_vae", False) else dtype,
        tokenizer_cache_dir=getattr(ns, "tokenizer_cache_dir", None),
        family_options=family_options,
        from_scratch=bool(getattr(ns, "from_scratch", False)),
        init_seed=seed if seed is not None else (getattr(ns, "seed", None) or 0),
    )
