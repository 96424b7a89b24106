"""The metadata written into every saved LoRA of a run: ss_* keys, modelspec.* and base-model hashes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from accelerate.state import PartialState

from library.core.hashes import cached_file_hashes
from library.core.metadata import modelspec_metadata, training_metadata
from library.data.dataset import TrainingData
from library.families.base import Components, ModelFamily
from library.train.settings import RunSettings


@dataclass
class RunFacts:
    """What the loop knows about the run at the moment of a save."""

    session_id: int
    started_at: float
    steps: int
    epoch: int
    num_epochs: int
    max_train_steps: int
    batches_per_epoch: int
    seed: int
    ss_optimizer: str


def _file_hashes(path: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(legacy hash, sha256) of a model file, as sd-scripts writes them; (None, None) for a diffusers folder, a
    hub id or a preset (sd-scripts writes "IsADirectory" for a folder). Cached by path, mtime and size, so a
    multi-GB checkpoint is read once, not at every save nor at every run."""
    if not path or not os.path.isfile(path):
        return None, None
    try:
        return cached_file_hashes(path)
    except OSError:
        return None, None


def _model_name(path: Optional[str]) -> Optional[str]:
    """ss_sd_model_name / ss_vae_name: the base name of an existing file or folder, otherwise the text given
    (a hub id, a preset), as sd-scripts records it."""
    if not path:
        return None
    return os.path.basename(os.path.normpath(path)) if os.path.exists(path) else path


def _num_processes() -> int:
    try:
        return int(PartialState().num_processes)
    except (RuntimeError, ValueError):
        return 1


def timestep_range(min_timestep: Optional[int], max_timestep: Optional[int]) -> Optional[tuple[int, int]]:
    """modelspec.timestep_range as sd-scripts fills it: absent unless a bound is given; a missing bound is 0 / 1000."""
    if min_timestep is None and max_timestep is None:
        return None
    return (0 if min_timestep is None else min_timestep, 1000 if max_timestep is None else max_timestep)


def _network_module(settings: RunSettings, family: ModelFamily) -> Any:
    """ss_network_module: the family's sd-scripts module for the project's LoRA (FLUX.1: networks.lora_flux),
    otherwise the module given."""
    kind = settings.network_kind
    return kind.metadata_module(family) if kind is not None else settings.network.network_module


def lora_metadata(family: ModelFamily, components: Components, settings: RunSettings, data: TrainingData,
                  facts: RunFacts) -> dict[str, str]:
    """Every ss_* and modelspec.* key of a LoRA saved now."""
    s, c = settings, components
    model_path = c.model_path or s.model.pretrained_model_name_or_path
    model_legacy, model_sha = _file_hashes(model_path)
    vae_legacy, vae_sha = _file_hashes(s.model.vae)
    run = dict(s.recorded_flags)
    run.update({
        "session_id": facts.session_id, "training_started_at": facts.started_at,
        "training_finished_at": time.time(), "steps": facts.steps, "epoch": facts.epoch,
        "num_epochs": facts.num_epochs, "max_train_steps": facts.max_train_steps,
        "num_batches_per_epoch": facts.batches_per_epoch, "seed": facts.seed,
        "optimizer": facts.ss_optimizer, "base_model_version": family.base_model_version(c),
        "sd_model_name": _model_name(model_path),
        "sd_model_hash": model_legacy, "new_sd_model_hash": model_sha,
        "vae_name": _model_name(s.model.vae),
        "vae_hash": vae_legacy, "new_vae_hash": vae_sha,
        "dataset_metadata": data.metadata(),
        "network_module": _network_module(s, family),
        "cache_latents": s.data.cache_latents,  # as used: --cache_latents_to_disk implies it
        "total_batch_size": s.data.train_batch_size * _num_processes() * s.training.gradient_accumulation_steps,
        "network_dim": s.network.network_dim, "network_alpha": s.network.network_alpha,
        "network_args": s.network.network_args,
        "v2": c.v2, "v_parameterization": c.v_parameterization,
        "no_metadata": s.network.no_metadata,
        "family_metadata": family.metadata_values(family.options(c)),
    })
    metadata = training_metadata(run)
    reso = data.resolution_for_metadata() or (512, 512)
    metadata.update(modelspec_metadata(
        architecture=family.modelspec_architecture(c, reso[0]),
        implementation=family.modelspec_implementation(), title=s.training.output_name,
        resolution=reso, prediction_type=family.modelspec_prediction_type(c),
        timestep_range=timestep_range(s.noise.min_timestep, s.noise.max_timestep),
        encoder_layer=s.text.clip_skip, date=None, is_lora=True, extra=s.network.metadata))
    return metadata


def model_metadata(family: ModelFamily, components: Components, settings: RunSettings, data: TrainingData,
                   facts: RunFacts) -> dict[str, str]:
    """The modelspec.* keys of a full model saved now (sd-scripts writes no ss_* keys into fine-tuned models)."""
    s, c = settings, components
    reso = data.resolution_for_metadata() or (512, 512)
    timestep_range = (s.noise.min_timestep, s.noise.max_timestep)
    return modelspec_metadata(
        architecture=family.modelspec_architecture(c, reso[0]), implementation=family.modelspec_implementation(),
        title=f"{s.training.output_name} (step {facts.steps})", resolution=reso,
        prediction_type="v" if c.v_parameterization else "epsilon",
        timestep_range=None if timestep_range == (None, None) else timestep_range,
        encoder_layer=s.text.clip_skip, date=None, is_lora=False, extra=s.fine_tune.metadata)


def embedding_metadata(family: ModelFamily, components: Components, settings: RunSettings, data: TrainingData,
                       facts: RunFacts) -> dict[str, str]:
    """The modelspec.* keys of a textual-inversion embedding, as sd-scripts writes them (architecture suffixed
    /textual-inversion), and (ours, sd-scripts writes no ss_* keys here) the token, its vector count, the init word,
    the step and the epoch."""
    s, c = settings, components
    reso = data.resolution_for_metadata() or (512, 512)
    metadata = modelspec_metadata(
        architecture=family.modelspec_architecture(c, reso[0]) + "/textual-inversion",
        implementation=family.modelspec_implementation(), title=s.training.output_name, resolution=reso,
        prediction_type=family.modelspec_prediction_type(c),
        timestep_range=timestep_range(s.noise.min_timestep, s.noise.max_timestep),
        encoder_layer=s.text.clip_skip, date=None, is_lora=False, extra=s.textual_inversion.metadata)
    ti = s.textual_inversion
    metadata.update({"ss_token_string": ti.token_string, "ss_num_vectors_per_token": str(ti.num_vectors_per_token),
                     "ss_init_word": ti.init_word or "", "ss_steps": str(facts.steps), "ss_epoch": str(facts.epoch)})
    return metadata
