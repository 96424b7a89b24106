"""Optional packages: setup.py extras, exact install hints, and --xformers applied or reported."""

from __future__ import annotations

import ast
import logging
import os
import re
import types

import pytest
import torch

import library.core.errors as core_errors
from library.train.memory import memory_setup
from library.train.memory.memory_setup import XFORMERS_MISSING, apply_xformers
from library.train.adapters.network_kinds import KNOWN_PACKAGES
from library.train.optim.optimizers import OPTIMIZERS
from tests.train_helpers import base_args, make_dataset, make_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extras() -> dict[str, list[str]]:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "EXTRAS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no EXTRAS")


def _bare(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0]


def test_every_optional_package_is_an_extra_named_by_its_hint():
    """Each package an install hint names is in the setup.py extra that hint names
    (optimizers -> [optim], network modules -> [<top package>])."""
    extras = _extras()
    optim = {_bare(r) for r in extras["optim"]}
    hinted = {spec.package for spec in OPTIMIZERS.values() if spec.package and spec.package != "transformers"}
    assert hinted <= optim, hinted - optim
    assert "bitsandbytes" in optim and "prodigyopt" in optim
    for top, pip_name in KNOWN_PACKAGES.items():
        assert pip_name in {_bare(r) for r in extras[top]}
    assert "xformers" in {_bare(r) for r in extras["xformers"]}
    required = open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8").read()
    for name in optim | {"lycoris-lora", "xformers"}:
        assert not re.search(rf"^{re.escape(name)}\b", required, re.M), f"{name} must stay optional"


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(core_errors, "_warned", set())


def test_xformers_without_the_package_warns_once_and_trains(tmp_path, caplog, monkeypatch, fresh_warnings):
    """--xformers without xformers installed: one warning that SDPA is used, and the run trains
    (it used to be refused as a ConfigError, after having been silently ignored)."""
    monkeypatch.setattr(memory_setup, "xformers_installed", lambda: False)
    data = make_dataset(str(tmp_path), n=1)
    with caplog.at_level(logging.WARNING):
        path = make_trainer(base_args(data, str(tmp_path / "out"), steps=1, extra=["--xformers"])).run()
    assert os.path.isfile(path)
    assert [r.getMessage() for r in caplog.records].count(XFORMERS_MISSING) == 1


class _Attn(torch.nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.calls = 0
        self.fail = fail

    def enable_xformers_memory_efficient_attention(self):
        self.calls += 1
        if self.fail:
            raise ValueError("torch.cuda.is_available() should be True but is False")


def test_xformers_is_applied_to_denoiser_and_vae_when_installed(monkeypatch, caplog, fresh_warnings):
    """With xformers installed, diffusers' enable_xformers_memory_efficient_attention is called on the
    denoiser and the VAE; a model that cannot use it keeps SDPA with one warning naming it."""
    monkeypatch.setattr(memory_setup, "xformers_installed", lambda: True)
    denoiser, vae = _Attn(), _Attn(fail=True)
    components = types.SimpleNamespace(denoiser=denoiser, vae=vae, text_encoders=[])
    with caplog.at_level(logging.WARNING):
        assert apply_xformers(components) == ["denoiser"]
    assert denoiser.calls == 1 and vae.calls == 1
    assert [r.getMessage() for r in caplog.records] == [
        "--xformers: cannot use xformers in the VAE (torch.cuda.is_available() should be True but is False); "
        "it uses PyTorch SDPA"]
