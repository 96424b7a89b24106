"""Metadata of a saved LoRA: the ss_* training keys, modelspec.* keys, hashes, and the save.

Key names and value formats follow sd-scripts so metadata viewers and UIs read
our files as theirs; every value is a string. One addition: we fill
`modelspec.hash_sha256`, which sd-scripts leaves out.
"""

from __future__ import annotations

import base64
import datetime
import json
import mimetypes
import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from library.core import hashes
from library.core.io_utils import atomic_path, save_safetensors_atomic
from library.core.tensors import unshared

TOOLKIT_NAME = "sd-lora-toolkit"
TOOLKIT_VERSION = "0.1.0"
MODELSPEC_VERSION = "1.0.1"

# Flags written as ss_<flag> = str(value), in sd-scripts' order.
MIRRORED_FLAGS: tuple[str, ...] = (
    "output_name", "learning_rate", "unet_lr", "gradient_checkpointing", "gradient_accumulation_steps",
    "max_train_steps", "lr_warmup_steps", "lr_scheduler", "network_module", "network_dim", "network_alpha",
    "network_dropout", "mixed_precision", "full_fp16", "v2", "clip_skip", "max_token_length", "cache_latents",
    "seed", "lowram", "noise_offset", "multires_noise_iterations", "multires_noise_discount",
    "adaptive_noise_scale", "zero_terminal_snr", "training_comment", "max_grad_norm", "caption_dropout_rate",
    "caption_dropout_every_n_epochs", "caption_tag_dropout_rate", "face_crop_aug_range", "prior_loss_weight",
    "min_snr_gamma", "scale_weight_norms", "ip_noise_gamma", "noise_offset_random_strength",
    "ip_noise_gamma_random_strength", "loss_type", "huber_schedule", "huber_scale", "huber_c", "fp8_base",
    "fp8_base_unet", "validation_seed", "validation_split", "max_validation_steps", "validate_every_n_epochs",
    "validate_every_n_steps", "resize_interpolation",
)
# Flags written as bool(value), so an unset flag reads "False" rather than "None".
BOOL_FLAGS = frozenset({"full_fp16", "v2", "cache_latents", "fp8_base", "fp8_base_unet"})
# ss_ names that differ from the flag name.
RENAMED_FLAGS: dict[str, str] = {"debiased_estimation": "debiased_estimation_loss"}
# Written only without a dataset config (sd-scripts' flat dataset keys); values as the flags give them.
FLAT_DATASET_FLAGS: dict[str, str] = {
    "batch_size_per_device": "train_batch_size", "resolution": "resolution", "color_aug": "color_aug",
    "flip_aug": "flip_aug", "random_crop": "random_crop", "shuffle_caption": "shuffle_caption",
    "keep_tokens": "keep_tokens",
}
FLAT_BOOL_FLAGS = frozenset({"color_aug", "flip_aug", "random_crop", "shuffle_caption"})
# Run facts (not flags) passed under these names and written as ss_<name>.
RUN_FACTS: tuple[str, ...] = (
    "session_id", "training_started_at", "training_finished_at", "steps", "epoch", "num_train_images",
    "num_validation_images", "num_reg_images", "num_batches_per_epoch", "num_epochs", "optimizer",
    "base_model_version", "sd_model_name", "sd_model_hash", "new_sd_model_hash", "vae_name", "vae_hash",
    "new_vae_hash",
)
# Run facts written only with the flat dataset keys (no dataset config), as sd-scripts does.
FLAT_RUN_FACTS: tuple[str, ...] = ("total_batch_size",)
# Every flag training_metadata reads from its `run`: the values RunSettings.recorded_flags keeps.
RECORDED_FLAGS: tuple[str, ...] = tuple(dict.fromkeys(
    MIRRORED_FLAGS + tuple(RENAMED_FLAGS.values()) + ("text_encoder_lr",) + tuple(FLAT_DATASET_FLAGS.values())))
# Kept with --no_metadata so that UIs can still filter LoRAs by base model and rank.
MINIMUM_KEYS: tuple[str, ...] = (
    "ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim", "ss_network_alpha", "ss_network_args",
)


def _text_encoder_lr(value: Any) -> Any:
    """sd-scripts records one text-encoder lr: the first of a list."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def training_metadata(run: Mapping[str, Any]) -> dict[str, str]:
    """All ss_* keys for a run: `run` is vars(args) plus the run facts named in RUN_FACTS.

    Also read from `run`: `dataset_metadata` (a dict of ss_* keys from the data
    layer: ss_datasets / ss_tag_frequency / ss_dataset_dirs, or the flat keys),
    `network_args` (a dict, written as JSON) and `no_metadata`.
    """
    md: dict[str, Any] = {}
    for flag in MIRRORED_FLAGS:
        value = run.get(flag)
        md[f"ss_{flag}"] = bool(value) if flag in BOOL_FLAGS else value
    for name, value in (run.get("family_metadata") or {}).items():  # e.g. Flux's timestep and guidance settings
        md[f"ss_{name}"] = value
    for ss_name, flag in RENAMED_FLAGS.items():
        md[f"ss_{ss_name}"] = bool(run.get(flag))
    md["ss_text_encoder_lr"] = _text_encoder_lr(run.get("text_encoder_lr"))
    for fact in RUN_FACTS:
        if run.get(fact) is not None:
            md[f"ss_{fact}"] = run[fact]
    dataset_md = dict(run.get("dataset_metadata") or {})
    if "ss_datasets" not in dataset_md:
        for ss_name, flag in FLAT_DATASET_FLAGS.items():
            value = run.get(flag)
            md[f"ss_{ss_name}"] = bool(value) if ss_name in FLAT_BOOL_FLAGS else value
        for fact in FLAT_RUN_FACTS:
            if run.get(fact) is not None:
                md[f"ss_{fact}"] = run[fact]
    # The data layer may pass its JSON values already encoded or as dicts/lists.
    md.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in dataset_md.items()})
    network_args = run.get("network_args")
    if network_args:
        md["ss_network_args"] = json.dumps(network_args if isinstance(network_args, dict) else list(network_args))
    out = {k: str(v) for k, v in md.items()}  # as sd-scripts: str() of every flag value, "None" included
    if run.get("no_metadata"):
        return {k: out[k] for k in MINIMUM_KEYS if k in out}
    return out


def _iso_date(date: Union[None, float, int, str, datetime.datetime]) -> str:
    if date is None:
        date = datetime.datetime.now()
    if isinstance(date, (int, float)):
        date = datetime.datetime.fromtimestamp(int(date))
    if isinstance(date, datetime.datetime):
        return date.replace(microsecond=0).isoformat()
    return str(date)


def modelspec_metadata(architecture: str, implementation: str, title: str, resolution: Union[int, Sequence[int]],
                       prediction_type: Optional[str] = None, timestep_range: Optional[Sequence[int]] = None,
                       encoder_layer: Optional[int] = None, date: Any = None, is_lora: bool = True,
                       extra: Optional[Mapping[str, Optional[str]]] = None) -> dict[str, str]:
    """modelspec.* keys (SAI model spec 1.0.1). `extra` holds the --metadata_* flag values.

    `modelspec.hash_sha256` is added at save time (see `with_hashes`).
    """
    extra = dict(extra or {})
    if isinstance(resolution, int):
        resolution = (resolution, resolution)
    md = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": architecture + ("/lora" if is_lora else ""),
        "modelspec.implementation": implementation,
        "modelspec.title": extra.get("metadata_title") or title,
        "modelspec.resolution": f"{resolution[0]}x{resolution[1]}",
        "modelspec.date": _iso_date(date),
        "modelspec.implementation_version": f"{TOOLKIT_NAME}/{TOOLKIT_VERSION}",
    }
    if prediction_type is not None:
        md["modelspec.prediction_type"] = prediction_type
    if isinstance(timestep_range, int):
        timestep_range = (timestep_range, timestep_range)
    if timestep_range is not None and any(t is not None for t in timestep_range):  # never "None,None"
        lo, hi = tuple(timestep_range)
        md["modelspec.timestep_range"] = f"{lo},{hi}"
    if encoder_layer is not None:
        md["modelspec.encoder_layer"] = str(encoder_layer)
    for key in MODELSPEC_TEXT_FIELDS:
        if extra.get(f"metadata_{key}") is not None:
            md[f"modelspec.{key}"] = str(extra[f"metadata_{key}"])
    if extra.get("metadata_thumbnail"):
        md["modelspec.thumbnail"] = thumbnail_data_url(extra["metadata_thumbnail"])
    return md


# The --metadata_<key> flags written as modelspec.<key> as given (sd-scripts' ModelSpecMetadata.from_args).
MODELSPEC_TEXT_FIELDS = ("author", "description", "license", "tags", "usage_hint", "merged_from", "trigger_phrase",
                         "preprocessor", "is_negative_embedding")


def thumbnail_data_url(value: str) -> str:
    """--metadata_thumbnail: a data: URL as it is, an image file as a base64 data: URL (as sd-scripts writes it)."""
    if value.startswith("data:"):
        return value
    mime = mimetypes.guess_type(value)[0] or "application/octet-stream"
    with open(value, "rb") as f:
        return f"data:{mime};base64,{base64.b64encode(f.read()).decode('ascii')}"


def with_hashes(state_dict: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]]) -> dict[str, str]:
    """Metadata plus sshs_model_hash / sshs_legacy_hash, and modelspec.hash_sha256 when modelspec keys exist.

    The model hash covers only the tensor-data section, which is exactly what the
    model spec asks `hash_sha256` to cover (written with a "0x" prefix).
    """
    md = dict(metadata or {})
    model_hash, legacy_hash = hashes.sshs_hashes(state_dict, md)
    md["sshs_model_hash"] = model_hash
    md["sshs_legacy_hash"] = legacy_hash
    if "modelspec.sai_model_spec" in md:
        md["modelspec.hash_sha256"] = "0x" + model_hash
    return md


def save_lora_state_dict(path: str, state_dict: Mapping[str, torch.Tensor],
                         metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write a LoRA file atomically: .safetensors with metadata and hashes, otherwise a torch pickle."""
    tensors = unshared(state_dict)  # split q/k/v views of one fused tensor are written as copies
    if os.path.splitext(path)[1] == ".safetensors":
        save_safetensors_atomic(tensors, path, with_hashes(tensors, metadata))
    else:
        with atomic_path(path) as tmp:
            torch.save(tensors, tmp)
