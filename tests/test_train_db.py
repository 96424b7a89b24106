"""train_db.py, sd-scripts' DreamBooth script: a full SD 1.x/2.x fine-tune whose text encoder trains by
default, --stop_text_encoder_training N freezing it after step N."""

import os
import subprocess
import sys

import pytest
import torch

from library.cli.config_file import parse_with_config_file
from library.cli.entry import build_parser, settings_from_args
from library.families import get_family
from library.families.base import LoadOptions
from library.train.trainer import Trainer
from tests.train_helpers import ft_args
from tests.train_helpers import make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def db_trainer(argv):
    family = get_family("sd")
    ns = parse_with_config_file(build_parser("test", family, fine_tune=True, dreambooth=True), argv)
    return Trainer(family, settings_from_args(ns, family, fine_tune=True))


def _te_after_each_step(trainer):
    states = []
    trainer.s.hooks.append(lambda t, event, step: states.append(
        {k: v.detach().clone() for k, v in t.components.text_encoders[0].state_dict().items()})
        if event == "step" else None)
    return states


def _changed(a, b):
    return {k for k in a if not torch.equal(a[k], b[k])}


def test_train_db_trains_two_steps_and_saves_one_file_that_loads_back(tmp_path):
    data = make_dataset(str(tmp_path / "data"), n=1)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_db.py"), *ft_args(data, str(out))],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["model.safetensors", "model_config.toml"]  # one model file, and the flags
    loaded = get_family("sd").load(LoadOptions(str(out / "model.safetensors")))
    base = get_family("sd").load(LoadOptions("tiny:sd1"))
    # the text encoder trained too (train_db.py's default), the VAE did not
    assert _changed(base.text_encoders[0].state_dict(), loaded.text_encoders[0].state_dict())
    assert _changed(base.denoiser.state_dict(), loaded.denoiser.state_dict())
    assert not _changed(base.vae.state_dict(), loaded.vae.state_dict())


@pytest.mark.parametrize("stop,te_changes", [(None, [True, True, True]), ("1", [True, False, False]),
                                             ("-1", [False, False, False])])
def test_stop_text_encoder_training(tmp_path, stop, te_changes):
    data = make_dataset(str(tmp_path / "data"), n=1)
    extra = ["--stop_text_encoder_training", stop] if stop else []
    trainer = db_trainer(ft_args(data, str(tmp_path / "out"), steps=3, extra=extra))
    states = _te_after_each_step(trainer)
    before = {k: v.clone() for k, v in get_family("sd").load(LoadOptions("tiny:sd1")).text_encoders[0].state_dict().items()}
    trainer.run()
    assert [bool(_changed(a, b)) for a, b in zip([before, *states[:-1]], states)] == te_changes


def test_stop_text_encoder_training_against_train_text_encoder(tmp_path):
    from library.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--train_text_encoder with --stop_text_encoder_training -1: "):
        db_trainer(ft_args(str(tmp_path), str(tmp_path / "o"), extra=["--train_text_encoder",
                                                                       "--stop_text_encoder_training", "-1"]))
