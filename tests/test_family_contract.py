"""The contract every registered model family keeps, checked on each of its tiny presets (in the spirit of
diffusers' ModelTesterMixin): the preset loads; the model saved as the family's single file loads back with
equal tensors; its LoRA modules get the family's kohya names, as many as recorded here; it generates an image;
and a LoRA run stopped and resumed from its --save_state equals the uninterrupted run, bitwise.

A new family is checked by registering it (library/families/__init__.py) and adding its tiny presets' rows to
the tables below; a family's own behaviour stays in its tests/test_<family>.py.
"""

from __future__ import annotations

import os
import shlex

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from library.cli.entry import build_parser
from library.cli.model import load_options_from_args
from library.cli.options import options_from_namespace
from library.core.errors import UserError
from library.families import get_family, registered_families
from library.families.base import LoadOptions
from library.sampling.generate import GenerationRequest
from networks.lora import create_network
from tests.train_helpers import base_args, make_dataset, make_trainer

# Every (family, tiny preset) of the registry.
PRESETS = [(family.name, preset) for family in registered_families() for preset in family.tiny_presets]

# (text-encoder modules, denoiser modules) that networks.lora creates on each tiny preset with the family's
# lora_targets, the optional targets (enabled_by) off, as a plain run trains. The SD and SDXL presets keep the
# real topology, so theirs are sd-scripts' own counts ("create LoRA for Text Encoder: 72 modules", U-Net: 192;
# SDXL 72 + 192 and 722); the others are the tiny presets' measured counts, kept so that a change shows.
LORA_MODULE_COUNTS = {
    "tiny:sd1": (72, 192), "tiny:sd2": (138, 192), "tiny:sd2-v": (138, 192), "tiny:sdxl": (264, 722),
    "tiny:flux": (72, 29), "tiny:flux_kontext": (72, 29), "tiny:chroma": (0, 22), "tiny:anima": (196, 30), "tiny:sd3": (264, 29),
    "tiny:lumina": (182, 42), "tiny:hunyuan_image": (0, 32), "tiny:zimage": (21, 10), "tiny:qwen_image": (0, 24),
    "tiny:qwen_image_edit": (0, 24), "tiny:flux2": (196, 22), "tiny:flux2_dev": (280, 22),
}

# The flags a LoRA run on each family's tiny preset needs besides train_helpers.base_args: short token
# lengths keep the runs fast; Chroma is trained through FLUX.1's script with --model_type chroma.
RUN_FLAGS = {
    "flux": ["--t5xxl_max_token_length", "16", "--guidance_scale", "1.0"],
    "chroma": ["--model_type", "chroma", "--apply_t5_attn_mask", "--guidance_scale", "0",
               "--t5xxl_max_token_length", "8"],
    "anima": ["--qwen3_max_token_length", "16", "--t5_max_token_length", "16"],
    "sd3": ["--t5xxl_max_token_length", "8"],
    "lumina": ["--gemma2_max_token_length", "16"],
    "zimage": ["--qwen3_max_token_length", "16"],
    "flux2": ["--qwen3_max_token_length", "32"],
}


@pytest.fixture(scope="module")
def loaded():
    """Each tiny preset loaded once for this module: {preset: (family, Components)}."""
    cache = {}

    def load(name: str, preset: str):
        if preset not in cache:
            family = get_family(name)
            cache[preset] = family, family.load(LoadOptions(preset))
        return cache[preset]

    return load


def _equal_state(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """The state-dict keys on which two modules differ (missing on one side, or not bitwise equal)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(set(sa) ^ set(sb)) + [k for k in sa if k in sb and not torch.equal(sa[k], sb[k])]


def test_every_family_has_a_tiny_preset_and_a_row_here():
    assert [name for name, _ in PRESETS] and {f.name for f in registered_families()} == {n for n, _ in PRESETS}
    assert sorted(p for _, p in PRESETS) == sorted(LORA_MODULE_COUNTS)


@pytest.mark.parametrize("name,preset", PRESETS)
def test_tiny_preset_loads_with_the_parts_its_facts_name(name, preset, loaded):
    family, c = loaded(name, preset)
    facts = family.facts()
    assert facts["name"] == name and preset in facts["tiny_presets"] and preset in facts["presets"]
    # One label per text encoder, except those a fine-tune trains only on request (SD3's T5-XXL: --train_t5xxl).
    assert len(facts["text_encoder_labels"]) == (family.fine_tune_text_encoders or len(c.text_encoders))
    assert c.model_path == preset and isinstance(c.denoiser, torch.nn.Module) and isinstance(c.vae, torch.nn.Module)
    # Loading is deterministic: a second load of the preset has the same weights, bitwise.
    again = family.load(LoadOptions(preset))
    assert _equal_state(c.denoiser, again.denoiser) == []


def _write_single_file(family, preset: str, root: str) -> dict[str, str]:
    """The preset as the family's single-file layout (write_preset with single_file=True): a model file (SD, SDXL:
    given as a .safetensors name) or a folder of component files."""
    try:
        return family.write_preset(preset, root, single_file=True)
    except UserError:
        return family.write_preset(preset, os.path.join(root, "model.safetensors"), single_file=True)


def _load_options(family, written: dict[str, str]) -> LoadOptions:
    """The LoadOptions the family's training script builds from the flags `preset_hint` gives for these files:
    its single-file alternative where it offers several ("--pretrained_model_name_or_path <folder>  (or <file>
    --qwen3 ...)"), without a leading script name."""
    def flags(alternative: str) -> list[str]:
        tokens = [t for t in shlex.split(alternative.strip(" )")) if not t.endswith(".py")]  # no script name
        if tokens and not tokens[0].startswith("--"):  # "(or <model file> --qwen3 ...)": the model path alone
            tokens = ["--pretrained_model_name_or_path", *tokens]
        return tokens

    alternatives = [flags(a) for a in family.preset_hint(written).split("(or ")]
    hint = next((a for a in alternatives if "--pretrained_model_name_or_path" in a
                 and a[a.index("--pretrained_model_name_or_path") + 1].endswith(".safetensors")), alternatives[0])
    if "--pretrained_model_name_or_path" not in hint:
        (model_path,) = written.values()
        hint = ["--pretrained_model_name_or_path", model_path, *hint]
    ns = build_parser("test", family).parse_args(hint)
    return load_options_from_args(ns, options_from_namespace(family.options_type, ns))


@pytest.mark.parametrize("name,preset", PRESETS)
def test_single_file_round_trip(name, preset, loaded, tmp_path):
    """The loaded model saved over the preset's single file (save_model, safetensors) loads back through the
    script's flags with every tensor equal: denoiser, text encoders and VAE."""
    family, c = loaded(name, preset)
    written = _write_single_file(family, preset, str(tmp_path))
    opts = _load_options(family, written)
    model_file = opts.pretrained_model_name_or_path
    os.remove(model_file)
    assert family.save_model(c, model_file, "safetensors") == model_file
    back = family.load(opts)
    assert back.model_path == model_file
    for what, a, b in [("denoiser", c.denoiser, back.denoiser), ("vae", c.vae, back.vae),
                       *((f"text_encoders[{i}]", a, b) for i, (a, b) in enumerate(zip(c.text_encoders,
                                                                                        back.text_encoders)))]:
        assert _equal_state(a, b) == [], what
    assert len(back.text_encoders) == len(c.text_encoders)


@pytest.mark.parametrize("name,preset", PRESETS)
def test_lora_module_names_follow_the_family_rule(name, preset, loaded, tmp_path):
    """networks.lora on the family's lora_targets: the kohya names are the family's canonical names (its
    lora_names rule is a fixed point on them), unique, prefixed by part, stable from build to build, and as many
    as recorded; the saved file holds exactly those modules and reads back unchanged through the family's
    convert_lora_state_dict."""
    family, c = loaded(name, preset)

    def build():
        targets = [t for t in family.lora_targets(c) if t.enabled_by is None]
        return create_network(1.0, 4, 4, c.vae, c.text_encoders, c.denoiser, lora_targets=targets)

    net = build()
    te = [m.lora_name for m in net.text_encoder_loras]
    unet = [m.lora_name for m in net.unet_loras]
    assert (len(te), len(unet)) == LORA_MODULE_COUNTS[preset]
    names = te + unet
    assert len(set(names)) == len(names)
    assert all(n.startswith("lora_te") for n in te) and all(n.startswith("lora_unet_") for n in unet)
    assert [family.canonical_lora_name(n) for n in names] == names
    assert names == [m.lora_name for m in (lambda n: n.text_encoder_loras + n.unet_loras)(build())]
    path = str(tmp_path / "lora.safetensors")
    net.save_weights(path, None, {})
    saved = load_file(path)
    assert {k.split(".", 1)[0] for k in saved} == set(names)
    assert set(family.convert_lora_state_dict(dict(saved))) == set(saved)


@pytest.mark.parametrize("name,preset", PRESETS)
def test_generates_a_seeded_image_of_the_asked_size(name, preset, loaded):
    family, c = loaded(name, preset)
    request = GenerationRequest("a red cube", seed=5, width=64, height=64, steps=2)
    first, = family.generate(c, [request])
    again, = family.generate(c, [GenerationRequest("a red cube", seed=5, width=64, height=64, steps=2)])
    assert first.image.size == (64, 64)
    pixels = np.asarray(first.image, dtype=np.int16)
    assert np.array_equal(pixels, np.asarray(again.image, dtype=np.int16))  # the same seed, the same image
    assert pixels.std() > 0  # not a blank image


# One preset per family: the resume contract is about the family's part of the state (its noise draws, its
# options), which the presets of one family share.
RESUME_PRESETS = [(family.name, family.tiny_presets[0]) for family in registered_families() if family.tiny_presets]


@pytest.mark.parametrize("name,preset", RESUME_PRESETS)
def test_lora_run_resumed_from_its_saved_state_equals_the_uninterrupted_run(name, preset, tmp_path):
    """2 steps with --save_state, then --resume for the 3rd: the same LoRA file as 3 steps at once, bitwise."""
    family = get_family(name)
    data = make_dataset(str(tmp_path), n=2)
    extra = ["--network_module", family.lora_network_module, "--network_train_unet_only",
             *RUN_FLAGS.get(name, [])]

    def run(out: str, steps: int, *more: str) -> dict:
        argv = base_args(data, str(tmp_path / out), preset, steps=steps, extra=[*extra, *more])
        return load_file(make_trainer(argv, name).run())

    straight = run("straight", 3)
    run("split", 2, "--save_state")
    state = os.path.join(str(tmp_path / "split"), "lora-state")
    assert os.path.isdir(state), os.listdir(tmp_path / "split")
    resumed = run("split", 3, "--resume", state)
    assert straight.keys() == resumed.keys()
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []
    assert any(v.abs().sum() > 0 for k, v in straight.items() if "lora_up" in k)  # it trained
