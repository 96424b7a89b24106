"""The sd-scripts command lines printed in docs/ run unchanged on the tiny presets.

Each fenced block after the marker comment in docs/train_network.md (SD 1.5, LyCORIS LoKr and LoHa),
docs/sdxl_train_network.md and docs/flux_train_network.md is read from the markdown here, so the docs and
the test cannot drift apart. Only these change, each for a reason a user's machine does not have:

- the model path (and FLUX.1's --clip_l / --t5xxl / --ae component paths) -> tiny:sd1 / tiny:sdxl / tiny:flux;
- the dataset (--train_data_dir / --dataset_config and the resolution / bucket sizes) -> a copy of
  examples/data at 64 px (a copy, because --cache_latents_to_disk writes beside the images);
- --output_dir -> a temporary folder; --max_train_epochs is dropped and --max_train_steps 1 added;
- --optimizer_type AdamW8bit -> AdamW when bitsandbytes is not installed (it is an optional extra);
- --mixed_precision bf16/fp16 -> no without a CUDA device (CPU bf16 convolutions are ~50x slower; fp16
  autocast needs a GPU), so the five runs stay within a minute.

The run goes in-process through library.cli.entry.run_training, as `accelerate launch X.py` would; loading a
tiny preset returns a copy of the session's shared tiny model (tests/conftest.py) instead of building it again.
The dataset is two of the example images (one square, one not), to keep the five runs short.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import re
import shlex

import pytest
import torch

from library.cli.entry import run_training
from library.families import get_family
from library.families.base import LoadOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- sd-scripts command line:"
SCRIPTS = {"train_network.py": ("sd", "tiny:sd1"), "sdxl_train_network.py": ("sdxl", "tiny:sdxl"),
           "flux_train_network.py": ("flux", "tiny:flux")}
DOCS = ("docs/train_network.md", "docs/sdxl_train_network.md", "docs/flux_train_network.md")

MODEL_PARTS = {"--clip_l", "--t5xxl", "--ae", "--vae", "--text_encoder1", "--text_encoder2"}
DATASET = {"--train_data_dir", "--dataset_config", "--in_json"}
SIZES = {"--resolution": "64", "--min_bucket_reso": "64", "--max_bucket_reso": "128"}


def documented_command_lines() -> list[tuple[str, str]]:
    """(doc:line, command) of every fenced block that follows the marker comment."""
    found = []
    for doc in DOCS:
        lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            if not line.startswith(MARKER):
                continue
            assert lines[i + 1].startswith("```"), f"{doc}:{i + 2}: the marker must be followed by a code block"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            text = "\n".join(lines[i + 2:end])
            text = re.sub(r"\\\n", " ", text)  # line continuations
            found.append((f"{doc}:{i + 3}", " ".join(t.split("#")[0] for t in text.splitlines())))
    return found


COMMANDS = documented_command_lines()


def _split(args: list[str]) -> list[tuple[str, list[str]]]:
    """[(--flag, [values...])] in order."""
    out: list[tuple[str, list[str]]] = []
    for token in args:
        if token.startswith("--"):
            out.append((token, []))
        else:
            assert out, f"a value without a flag: {token}"
            out[-1][1].append(token)
    return out


def adapt(command: str, data_dir: str, dataset_toml: str, out_dir: str) -> tuple[str, str, list[str]]:
    """(family, script, argv) of a documented command with only the substitutions listed in the module doc."""
    tokens = shlex.split(command)
    script_at = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
    script = os.path.basename(tokens[script_at])
    family, preset = SCRIPTS[script]
    argv: list[str] = []
    for flag, values in _split(tokens[script_at + 1:]):
        if flag == "--pretrained_model_name_or_path":
            values = [preset]
        elif flag in MODEL_PARTS or flag == "--max_train_epochs":
            continue
        elif flag == "--dataset_config":
            values = [dataset_toml]
        elif flag in DATASET:
            values = [data_dir]
        elif flag in SIZES:
            values = [SIZES[flag]]
        elif flag == "--output_dir":
            values = [out_dir]
        elif flag == "--optimizer_type" and values[0].lower().endswith("8bit") \
                and importlib.util.find_spec("bitsandbytes") is None:
            values = ["AdamW"]
        elif flag == "--mixed_precision" and not torch.cuda.is_available():
            values = ["no"]
        argv += [flag, *values]
    given = {flag for flag, _ in _split(argv)}
    if given & DATASET and "--dataset_config" not in given:  # bucket sizes that fit the 64 px example resolution
        argv += [x for flag, value in SIZES.items() if flag not in given for x in (flag, value)]
    return family, script, argv + ["--max_train_steps", "1", "--max_data_loader_n_workers", "0"]


@pytest.fixture
def shared_tiny_models(monkeypatch, tiny_store):
    """family.load of a plain tiny preset returns a private copy of the session's shared model."""
    building: set[str] = set()  # the store builds a missing model through load itself
    for name in ("sd", "sdxl", "flux"):
        cls = type(get_family(name))

        def load(self, opts, _original=cls.load):
            preset = opts.pretrained_model_name_or_path
            if (tiny_store.is_tiny_preset(preset) and preset not in building
                    and dataclasses.replace(opts, family_options=None) == LoadOptions(preset)):
                building.add(preset)
                try:
                    shared = tiny_store.model(preset, share=False)
                finally:
                    building.discard(preset)
                components = copy.deepcopy(shared)
                if opts.family_options is not None:
                    components.options = opts.family_options
                return components
            return _original(self, opts)

        monkeypatch.setattr(cls, "load", load)


def test_the_docs_print_every_expected_command_line():
    """SD 1.5, SDXL, FLUX.1 and the LyCORIS LoKr / LoHa command lines are all there to be run."""
    text = " ".join(cmd for _, cmd in COMMANDS)
    scripts = [next(t for t in shlex.split(cmd) if t.endswith(".py")) for _, cmd in COMMANDS]
    assert set(scripts) == set(SCRIPTS)
    assert "algo=lokr" in text and "algo=loha" in text


@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_sd_scripts_command_line_runs(where, command, example_data, shared_tiny_models, tmp_path, capsys):
    """The documented command trains one step and saves its LoRA."""
    data_dir, dataset_toml = example_data
    out_dir = str(tmp_path / "out")
    family, script, argv = adapt(command, data_dir, dataset_toml, out_dir)
    code = run_training(family, script, argv)
    captured = capsys.readouterr()
    assert code == 0, f"{where}: exit {code}: {captured.err.strip().splitlines()[-1:] if captured.err else ''}"
    saved = [n for n in os.listdir(out_dir) if n.endswith(".safetensors")]
    assert len(saved) == 1, (where, os.listdir(out_dir))
