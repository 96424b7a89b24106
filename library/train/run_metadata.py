"""The metadata written into every saved LoRA of a run: ss_* keys, modelspec.* and base-model hashes."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Optional

from library.core.hashes import file_legacy_hash, file_sha256
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


@functools.lru_cache(maxsize=16)
def _file_hashes(path: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(legacy hash, sha256) of a model file, computed once per process; (None, None) for folders/presets."""
    if not path or not os.path.isfile(path):
        return None, None
    return file_legacy_hash(path), file_sha256(path)


def lora_metadata(family: ModelFamily, components: Components, settings: RunSettings, data: TrainingData,
                  facts: RunFacts) -> dict[str, str]:
    """Every ss_* and modelspec.* key of a LoRA saved now."""
    s, c = settings, components
    model_path = c.model_path or s.model.pretrained_model_name_or_path
    model_legacy, model_sha = _file_hashes(c.model_path)
    vae_legacy, vae_sha = _file_hashes(s.model.vae)
    run = dict(s.recorded_flags)
    run.update({
        "session_id": facts.session_id, "training_started_at": facts.started_at,
        "training_finished_at": time.time(), "steps": facts.steps, "epoch": facts.epoch,
        "num_epochs": facts.num_epochs, "max_train_steps": facts.max_train_steps,
        "num_batches_per_epoch": facts.batches_per_epoch, "seed": facts.seed,
        "optimizer": facts.ss_optimizer, "base_model_version": family.base_model_version(c),
        "sd_model_name": os.path.basename(os.path.normpath(model_path)),
        "sd_model_hash": model_legacy, "new_sd_model_hash": model_sha,
        "vae_name": os.path.basename(s.model.vae) if s.model.vae else None,
        "vae_hash": vae_legacy, "new_vae_hash": vae_sha,
        "dataset_metadata": data.metadata(),
        "network_module": s.network.network_module,
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
        resolution=reso, prediction_type="v" if c.v_parameterization else "epsilon",
        timestep_range=(s.noise.min_timestep, s.noise.max_timestep),
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
