"""Sample prompt files: every format and inline option (golden), errors with file and line, sampler names."""

from __future__ import annotations

import json

import pytest

from library.core.errors import ConfigError
from library.sampling.prompt_weighting import parse_prompt_attention
from library.sampling.prompts import SamplePrompt, load_prompts, parse_prompt_line
from library.sampling.samplers import canonical_sampler, make_scheduler, sampler_names

TXT = """# sample prompts
a photo of a cat --n blurry, lowres --w 640 --h 384 --d 42 --s 20 --l 6.5 --g 3.5 --ss k_euler_a

   # an indented comment
masterpiece, 1girl, (smile:1.2)
a dog --W 512 --N ugly --D 7
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_txt_every_inline_option(tmp_path):
    prompts = load_prompts(write(tmp_path, "p.txt", TXT), check_sampler=canonical_sampler)
    assert prompts == [
        SamplePrompt("a photo of a cat", "blurry, lowres", width=640, height=384, seed=42, steps=20, scale=6.5,
                     guidance=3.5, sampler="k_euler_a", index=0),
        SamplePrompt("masterpiece, 1girl, (smile:1.2)", index=1),
        # option names are case-insensitive, as in sd-scripts
        SamplePrompt("a dog", "ugly", width=512, seed=7, index=2),
    ]


def test_toml_defaults_and_subsets(tmp_path):
    text = """
[prompt]
width = 512
height = 768
scale = 5
sample_steps = 28
negative_prompt = "lowres"

[[prompt.subset]]
prompt = "a cat"
seed = 1

[[prompt.subset]]
prompt = "a dog --w 64"
width = 256
sample_sampler = "dpmsolver++"
guidance_scale = 3.5
"""
    prompts = load_prompts(write(tmp_path, "p.toml", text))
    assert prompts == [
        SamplePrompt("a cat", "lowres", width=512, height=768, seed=1, steps=28, scale=5.0, index=0),
        # a table's prompt is taken as written (no inline options), as sd-scripts does
        SamplePrompt("a dog --w 64", "lowres", width=256, height=768, steps=28, scale=5.0, guidance=3.5,
                     sampler="dpmsolver++", index=1),
    ]


def test_json_strings_and_objects(tmp_path):
    data = ["a cat --d 3 --s 10",
            {"prompt": "a dog", "negative_prompt": "bad", "width": 320, "height": 256, "seed": 9,
             "sample_steps": 12, "scale": 4.0, "sample_sampler": "euler"}]
    prompts = load_prompts(write(tmp_path, "p.json", json.dumps(data, indent=1)))
    assert prompts == [
        SamplePrompt("a cat", seed=3, steps=10, index=0),
        SamplePrompt("a dog", "bad", width=320, height=256, seed=9, steps=12, scale=4.0, sampler="euler", index=1),
    ]


def test_sd_scripts_only_options_are_kept_aside():
    p = parse_prompt_line("a cat --cn hint.png --ctr 0.25 --fs 3 --rcfg 0.5 --n", "p.txt:1")
    assert p.prompt == "a cat" and p.negative_prompt == ""
    assert p.ignored == {"ctr": "0.25", "fs": "3", "rcfg": "0.5"}
    assert p.control_image == "hint.png"  # the ControlNet scripts' control image (docs/controlnet.md)


@pytest.mark.parametrize("name,text,message", [
    ("p.txt", "# c\n\na cat --w 512\na dog --q 3\n",
     "p.txt:4: unknown option --q; expected one of --n, --w, --h, --d, --s, --l, --g, --ss, --ci, --cn"),
    ("p.txt", "a cat --w wide\n", "p.txt:1: --w: expected an integer width in pixels, got 'wide'"),
    ("p.txt", "a cat --s 1.5\n", "p.txt:1: --s: expected an integer number of steps, got '1.5'"),
    ("p.txt", "ok\n\na cat --l high\n", "p.txt:3: --l: expected a number (CFG scale), got 'high'"),
    ("p.txt", "a cat --h 0\n", "p.txt:1: --h: expected an integer >= 1, got 0"),
    ("p.txt", "a cat --d\n", "p.txt:1: --d: expected an integer seed, got nothing"),
    ("p.txt", "a cat\nx --ss k_dpmpp\n",
     "p.txt:2: sampler 'k_dpmpp': expected one of " + ", ".join(sampler_names())),
    ("p.txt", "--w 512\n", "p.txt:1: the prompt is empty (only options)"),
    ("p.txt", "# nothing\n", "p.txt: no prompts in the file"),
    ("p.toml", "[prompt]\n[[prompt.subset]]\nprompt = 'a'\nsteps = 20\n",
     "p.toml: prompt.subset[0]: unknown key 'steps'; expected one of prompt, negative_prompt, width, height, "
     "seed, sample_steps, scale, guidance_scale, sample_sampler, control_image, controlnet_image"),
    ("p.toml", "[prompt]\n[[prompt.subset]]\nprompt = 'a'\nwidth = '512'\n",
     "p.toml: prompt.subset[0]: width: expected an integer, got '512'"),
    ("p.toml", "[prompt]\nwidth = 5\n[[prompt.subset]]\nprompt = 'a'\nwidth = 1.5\n",
     "p.toml: prompt.subset[0]: width: expected an integer, got 1.5"),
    ("p.toml", "[prompt\n", "p.toml:1: not valid TOML (Key group not on a line by itself.)"),
    ("p.toml", "prompt = 'a'\n", "p.toml: expected a [prompt] table with [[prompt.subset]] entries"),
    ("p.json", '[\n "a",\n {"prompt": "b",}\n]', "p.json:3: not valid JSON (Expecting property name enclosed in "
                                                   "double quotes)"),
    ("p.json", '["a", 3]', "p.json: [1]: expected a string or an object, got int"),
    ("p.json", '[{"negative_prompt": "x"}]', "p.json: [0]: prompt: expected a non-empty string"),
    ("p.json", '{"prompt": "a"}', "p.json: expected a JSON list of prompts (strings or objects)"),
    ("p.yaml", "a", "p.yaml: expected a .txt, .toml or .json prompt file, got '.yaml'"),
])
def test_bad_prompt_files_name_file_and_line(tmp_path, name, text, message):
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as e:
        load_prompts(path, check_sampler=canonical_sampler)
    # messages start with the path as given, then the line (or entry) number
    assert str(e.value) == str(tmp_path) + "/" + message
    assert "\n" not in str(e.value)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^/.*nope.txt: file not found$"):
        load_prompts(str(tmp_path / "nope.txt"))


def test_missing_prompt_file_is_named_once_with_its_flag(tmp_path, capsys):
    from library.cli.entry import run_training
    from tests.train_helpers import base_args, make_dataset
    from tools import generate

    missing = str(tmp_path / "nope.txt")
    argv = base_args(make_dataset(str(tmp_path), n=1), str(tmp_path / "out"), steps=1,
                     extra=["--sample_prompts", missing])
    assert run_training("sd", "test", argv) == 2
    assert capsys.readouterr().err.strip() == f"error: --sample_prompts: {missing}: file not found"
    assert generate.main(["--ckpt", "tiny:sd1", "--outdir", str(tmp_path), "--from_file", missing]) == 2
    assert capsys.readouterr().err.strip() == f"error: --from_file: {missing}: file not found"


def test_bad_prompt_file_fails_before_training(tmp_path, capsys):
    """The training script reports the line and exits 2 before any model is loaded."""
    from library.cli.entry import run_training
    from tests.train_helpers import base_args, make_dataset

    data = make_dataset(str(tmp_path), n=1)
    prompts = write(tmp_path, "prompts.txt", "a cat --d 1\na dog --w big\n")
    argv = base_args(data, str(tmp_path / "out"), extra=["--sample_prompts", prompts, "--sample_every_n_steps", "2"])
    assert run_training("sd", "test", argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --sample_prompts: {prompts}:2: --w: expected an integer width in pixels, got 'big'"]
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_sampler_names_and_aliases():
    assert sampler_names("ddpm") == [
        "ddim", "ddpm", "dpm_2", "dpm_2_a", "dpmsingle", "dpmsolver", "dpmsolver++", "euler", "euler_a", "heun",
        "k_dpm_2", "k_dpm_2_a", "k_euler", "k_euler_a", "k_lms", "lms", "pndm"]
    assert sampler_names("flow") == ["euler_flow", "flow_euler"]
    assert [canonical_sampler(n) for n in ("K_EULER_A", "k_lms", "dpm_2_a", "dpmsolver++")] == \
        ["euler_a", "lms", "dpm_2_a", "dpmsolver++"]


def test_schedulers_classes_and_kinds():
    base = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "prediction_type": "v_prediction"}
    classes = {n: type(make_scheduler(n, base)).__name__ for n in sampler_names("ddpm")}
    assert classes["k_euler_a"] == "EulerAncestralDiscreteScheduler"
    assert classes["dpm_2_a"] == "KDPM2AncestralDiscreteScheduler"
    assert classes["dpmsingle"] == "DPMSolverSinglestepScheduler"
    dpm = make_scheduler("dpmsolver", base)
    assert (dpm.config.algorithm_type, dpm.config.prediction_type) == ("dpmsolver", "v_prediction")
    assert make_scheduler("dpmsolver++", base).config.algorithm_type == "dpmsolver++"
    assert type(make_scheduler("flow_euler", {"num_train_timesteps": 1000}, kind="flow")).__name__ == \
        "FlowMatchEulerDiscreteScheduler"
    with pytest.raises(ConfigError, match="^sampler 'ddim': not usable with this model \\(flow sampling\\); "
                                          "expected one of euler_flow, flow_euler$"):
        make_scheduler("ddim", base, kind="flow")


@pytest.mark.parametrize("text,runs", [
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", 1.1)]),
    ("\\(literal\\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.1 * 1.1 * 1.3), (" ", 1.1), ("on", 1.1 / 1.1), (" a ", 1.1), ("hill", 0.55),
      (", sun, ", 1.1), ("sky", 1.1 ** 4), (".", 1.1)]),
    ("ratio 16:9) here", [("ratio 16:9) here", 1.0)]),
    ("[[bad]] (good: 1.5 )", [("bad", 1 / 1.1 / 1.1), (" ", 1.0), ("good", 1.5)]),
])
def test_prompt_attention(text, runs):
    got = parse_prompt_attention(text)
    assert [t for t, _ in got] == [t for t, _ in runs]
    assert [w for _, w in got] == pytest.approx([w for _, w in runs], rel=1e-12)
