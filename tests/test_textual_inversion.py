"""Textual inversion (train_textual_inversion.py, sdxl_train_textual_inversion.py; docs/textual_inversion.md): only
the new token's vectors train, the files are sd-scripts' (and load in diffusers), --weights and --resume continue
exactly, bad input stops in one line, sampling / --embeddings / tools/generate.py use the embeddings."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.cli.config_file import parse_with_config_file
from library.cli.entry import build_parser, run_training, settings_from_args
from library.families import get_family
from library.train.trainer import InterruptedTraining, Trainer
from tests.train_helpers import base_args, make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ti_args(data: str, out: str, preset: str = "tiny:sd1", steps: int = 2, extra=()) -> list[str]:
    """base_args without the network flags, AdamW (weight decay: it would move every row it saw), token mytok
    of 2 vectors from "a" (one token of the tiny tokenizer, repeated)."""
    argv = base_args(data, out, preset=preset, steps=steps)
    for flag in ("--network_module", "--network_dim", "--network_alpha", "--output_name"):
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv + ["--token_string", "mytok", "--init_word", "a", "--num_vectors_per_token", "2",
                   "--optimizer_type", "AdamW", "--learning_rate", "1e-2", *extra]


def ti_trainer(argv, family_name="sd") -> Trainer:
    family = get_family(family_name)
    ns = parse_with_config_file(build_parser("test", family, textual_inversion=True), argv)
    return Trainer(family, settings_from_args(ns, family, textual_inversion=True))


def _run_script(script, argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("script,preset,shapes", [
    ("train_textual_inversion.py", "tiny:sd1", {"emb_params": (2, 32)}),
    ("sdxl_train_textual_inversion.py", "tiny:sdxl", {"clip_l": (2, 32), "clip_g": (2, 64)}),
])
def test_script_trains_two_steps_and_saves_sd_scripts_file(tmp_path, script, preset, shapes):
    data = make_dataset(str(tmp_path / "data"), n=1)
    out = tmp_path / "out"
    proc = _run_script(script, ti_args(data, str(out), preset=preset))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["mytok.safetensors", "mytok_config.toml"]  # named after the token
    with safe_open(str(out / "mytok.safetensors"), "pt") as f:
        assert {k: tuple(f.get_tensor(k).shape) for k in f.keys()} == shapes
        meta = f.metadata()
    assert meta["modelspec.architecture"].endswith("/textual-inversion")
    assert meta["ss_token_string"] == "mytok" and meta["ss_num_vectors_per_token"] == "2"
    assert oct(os.stat(out / "mytok.safetensors").st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("family_name,preset", [("sd", "tiny:sd1"), ("sdxl", "tiny:sdxl")])
def test_only_the_new_rows_train(tmp_path, family_name, preset):
    data = make_dataset(str(tmp_path / "data"), n=2)
    trainer = ti_trainer(ti_args(data, str(tmp_path / "out"), preset=preset, steps=3,
                                 extra=["--use_object_template"]), family_name)
    before = {}

    def snapshot(t, event, step):
        if event == "train_start":
            c = t.components
            before.update({f"te{i}.{k}": v.detach().clone() for i, te in enumerate(c.text_encoders)
                           for k, v in te.state_dict().items()})
            before.update({f"unet.{k}": v.detach().clone() for k, v in c.denoiser.state_dict().items()})
            before.update({f"new.{k}": v.detach().clone() for k, v in t.trainable.module.state_dict().items()})

    trainer.s.hooks.append(snapshot)
    path = trainer.run()
    c = trainer.components
    after = {f"te{i}.{k}": v for i, te in enumerate(c.text_encoders) for k, v in te.state_dict().items()}
    after.update({f"unet.{k}": v for k, v in c.denoiser.state_dict().items()})
    frozen = [k for k in after]
    assert any(k.endswith("token_embedding.weight") for k in frozen)
    changed = [k for k in frozen if not torch.equal(before[k], after[k])]
    assert changed == []  # every row of every table, the rest of each text encoder and the UNet: bitwise
    saved = load_file(path)
    keys = get_family(family_name).textual_inversion_keys
    assert sorted(saved) == sorted(keys)
    for i, key in enumerate(keys):
        assert not torch.equal(saved[key], before[f"new.{key}"])  # the new rows did train
        table = c.text_encoders[i].get_input_embeddings().weight
        assert torch.equal(before[f"new.{key}"], table[[320, 320]].float())  # started at "a", both vectors
        ids = c.tokenizers[i].convert_tokens_to_ids(["mytok", "mytok1"])
        assert ids == [table.shape[0], table.shape[0] + 1]
        # the encoder looks the new ids up in what was saved (what sampling and the step see)
        looked_up = c.text_encoders[i].get_input_embeddings()(torch.tensor([ids]))[0]
        assert torch.equal(looked_up, saved[key].to(looked_up.dtype))


def test_diffusers_loads_our_sd1_embedding(tmp_path):
    from diffusers import StableDiffusionPipeline

    from library.families.sd.saving import write_preset

    data = make_dataset(str(tmp_path / "data"), n=1)
    path = ti_trainer(ti_args(data, str(tmp_path / "out"))).run()
    folder = str(tmp_path / "pipe")
    write_preset("tiny:sd1", folder, single_file=False)
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    pipe.load_textual_inversion(path, token="mytok")
    ids = pipe.tokenizer.convert_tokens_to_ids(["mytok", "mytok_1"])  # diffusers' names of the 2 vectors
    rows = pipe.text_encoder.get_input_embeddings().weight[ids]
    assert torch.equal(rows, load_file(path)["emb_params"].to(rows.dtype))


def test_weights_continues_from_a_file(tmp_path):
    data = make_dataset(str(tmp_path / "data"), n=1)
    start = {"emb_params": torch.arange(64, dtype=torch.float32).reshape(2, 32) / 64}
    save_file(start, str(tmp_path / "start.safetensors"))
    trainer = ti_trainer(ti_args(data, str(tmp_path / "out"), extra=["--weights", str(tmp_path / "start.safetensors")]))
    seen = {}
    trainer.s.hooks.append(lambda t, event, step: seen.setdefault(
        "rows", t.trainable.module["emb_params"].detach().clone()) if event == "train_start" else None)
    trainer.run()
    assert torch.equal(seen["rows"], start["emb_params"])
    # A1111's .pt ({"string_to_param": {"*": tensor}}) too; a vector count that differs is one line before training
    torch.save({"string_to_param": {"*": start["emb_params"][:1]}}, str(tmp_path / "one.pt"))
    with pytest.raises(Exception, match=r"^--weights .*one\.pt: emb_params has 1 vector\(s\) but "
                                        r"--num_vectors_per_token is 2$"):
        ti_trainer(ti_args(data, str(tmp_path / "out2"), extra=["--weights", str(tmp_path / "one.pt")])).run()


def test_resume_is_bitwise_equal(tmp_path):
    data = make_dataset(str(tmp_path / "data"), n=2)
    extra = ["--shuffle_caption"]
    straight = load_file(ti_trainer(ti_args(data, str(tmp_path / "a"), steps=4, extra=extra)).run())
    out = str(tmp_path / "b")
    first = ti_trainer(ti_args(data, out, steps=4, extra=extra + ["--save_state"]))

    def stop_at_2(trainer, event, step):
        if event == "step" and step == 2:
            trainer._on_signal(15, None)

    first.s.hooks.append(stop_at_2)
    with pytest.raises(InterruptedTraining):
        first.run()
    resumed = load_file(ti_trainer(ti_args(data, out, steps=4, extra=extra + ["--resume", "auto"])).run())
    assert torch.equal(resumed["emb_params"], straight["emb_params"])


@pytest.mark.parametrize("drop,add,message", [
    ("--token_string", [], "error: --token_string: required (the new token to train, e.g. --token_string mychar4)"),
    (None, ["--init_word", "toy"], "error: --init_word 'toy': 3 tokens but --num_vectors_per_token is 2; "
                                   "use --num_vectors_per_token 3 or fewer words"),
    (None, ["--token_string", "a"], "error: --token_string a: the tokenizer already has this token; use another "
                                    "string (sd-scripts refuses it too)"),
])
def test_bad_input_is_one_line(tmp_path, capsys, drop, add, message):
    data = make_dataset(str(tmp_path / "data"), n=1)
    argv = ti_args(data, str(tmp_path / "out"))
    if drop:
        i = argv.index(drop)
        del argv[i:i + 2]
    assert run_training("sd", "test", argv + add, textual_inversion=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == message
    assert not os.path.exists(tmp_path / "out" / "mytok.safetensors")


def test_sampling_sees_the_trained_token(tmp_path, monkeypatch):
    import library.train.sampling_hook as hook

    data = make_dataset(str(tmp_path / "data"), n=1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a mytok --w 64 --h 64 --s 1\n")
    seen = []

    def fake_generate(family, components, requests, **kw):
        te = components.text_encoders[0]
        ids = components.tokenizers[0](requests[0].prompt, add_special_tokens=False).input_ids
        seen.append((requests[0].prompt, ids, te.get_input_embeddings()(torch.tensor([ids]))[0].detach().clone()))
        return []

    monkeypatch.setattr(hook, "generate_with_image_networks",
                        lambda family, components, networks, requests, **kw: fake_generate(family, components,
                                                                                           requests, **kw))
    trainer = ti_trainer(ti_args(data, str(tmp_path / "out"),
                                 extra=["--sample_prompts", str(prompts), "--sample_every_n_steps", "2"]))
    path = trainer.run()
    (prompt, ids, rows), = seen
    assert prompt == "a mytok mytok1"  # the token spelled out as its 2 vectors, as sd-scripts' prompt replacement
    assert ids == [320, 987, 988]
    assert torch.equal(rows[1:], load_file(path)["emb_params"])  # the trained vectors at that step (the last)


def test_lora_training_and_generate_use_embeddings(tmp_path):
    from tests.train_helpers import make_trainer
    from tools.generate import main as generate_main

    data = make_dataset(str(tmp_path / "data"), n=1)
    emb = {"emb_params": torch.randn(2, 32, generator=torch.Generator().manual_seed(0))}
    save_file(emb, str(tmp_path / "mytok.safetensors"))
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), steps=1,
                                     extra=["--embeddings", str(tmp_path / "mytok.safetensors")]))
    trainer.run()
    c = trainer.components
    ids = c.tokenizers[0].convert_tokens_to_ids(["mytok", "mytok1"])
    assert ids == [987, 988]
    assert torch.equal(c.text_encoders[0].get_input_embeddings()(torch.tensor([ids]))[0], emb["emb_params"])
    assert trainer.data.caption_replacements == (("mytok", "mytok mytok1"),)
    assert generate_main(["--ckpt", "tiny:sd1", "--outdir", str(tmp_path / "gen"), "--prompt",
                          "a mytok --w 64 --h 64 --s 1 --d 1", "--textual_inversion_embeddings",
                          str(tmp_path / "mytok.safetensors")]) == 0
    assert len(os.listdir(tmp_path / "gen")) == 1


def test_web_ui_templates_pass_the_scripts_check(tmp_path, monkeypatch):
    """The web UI learns the scripts from the families' facts: a job from each textual-inversion template runs its
    script, and with the tiny model and the example images saving passes that script's own --check_config."""
    from fastapi.testclient import TestClient

    from webui import performance
    from webui.app import create_app
    from webui.jobfiles import REPO_ROOT

    flags = frozenset(o[0] for o in performance.OPTIONS) | set(performance.MEMORY_FLAGS)
    monkeypatch.setattr(performance, "trainer_flags", lambda script, timeout=120: flags)
    jobs_dir = str(tmp_path / "jobs")
    c = TestClient(create_app(jobs_dir, find_gpus=list, data_roots=[REPO_ROOT, "/models"]))
    for family, script in (("sd", "train_textual_inversion.py"), ("sdxl", "sdxl_train_textual_inversion.py")):
        r = c.post("/api/jobs", json={"template": f"{family}_textual_inversion"})
        assert r.status_code == 201, r.text
        job = r.json()
        assert (job["family"], job["script"]) == (family, script)
        settings = c.get(f"/api/jobs/{job['id']}/settings").json()
        assert settings["config"]["textual_inversion"]["token_string"] == "mychar4"
        settings["config"]["model"]["pretrained_model_name_or_path"] = "tiny:sd1" if family == "sd" else "tiny:sdxl"
        settings["config"]["textual_inversion"]["init_word"] = "a"
        settings["dataset"]["datasets"][0]["subsets"][0]["image_dir"] = "examples/data/train/10_sks shape"
        r = c.put(f"/api/jobs/{job['id']}/settings", json=settings)
        assert r.status_code == 200, r.text
        settings["config"]["textual_inversion"]["token_string"] = ""  # the script's own one-line refusal
        r = c.put(f"/api/jobs/{job['id']}/settings", json=settings)
        assert r.status_code == 422 and "--token_string: required" in r.text, r.text


def test_sd_scripts_textual_inversion_flags_are_taken():
    """sd-scripts 48d368fa's train_textual_inversion.py parser: train_db.py's shared groups (less DreamBooth's own
    flags, the saving flags it does not add and --dataset_class, refused everywhere) plus its own flags."""
    import json

    theirs = set(json.load(open(os.path.join(ROOT, "tests", "data", "sd_scripts_flags.json")))["scripts"]["train_db.py"])
    theirs -= {"--dataset_class", "--fused_backward_pass", "--learning_rate_te", "--no_token_padding",
               "--stop_text_encoder_training", "--use_safetensors"}
    theirs |= {"--save_model_as", "--weights", "--num_vectors_per_token", "--token_string", "--init_word",
               "--use_object_template", "--use_style_template", "--no_half_vae"}
    for family in ("sd", "sdxl"):
        parser = build_parser("x", get_family(family), textual_inversion=True)
        ours = {o for a in parser._actions for o in a.option_strings}
        assert sorted(theirs - ours) == []


@pytest.mark.parametrize("extra,expected", [
    (["--use_object_template"], "object"), (["--use_style_template"], "style"), ([], "captions"),
])
def test_captions_templates_and_spelled_out_token(tmp_path, capsys, extra, expected):
    from library.train.adapters.textual_inversion import OBJECT_TEMPLATES, STYLE_TEMPLATES

    root = tmp_path / "data"
    data = make_dataset(str(root), n=2)
    for name in os.listdir(os.path.join(data, "5_sks toy")):
        if name.endswith(".txt"):
            (root / "train" / "5_sks toy" / name).write_text("mytok, square")
    ti_trainer(ti_args(data, str(tmp_path / "out"), extra=extra)).debug_dataset()
    captions = [line.split("caption: ", 1)[1] for line in capsys.readouterr().out.splitlines() if "caption: " in line]
    assert len(captions) == 10  # 2 images x 5 repeats
    if expected == "captions":
        assert set(captions) == {"mytok mytok1, square"}
    else:
        templates = OBJECT_TEMPLATES if expected == "object" else STYLE_TEMPLATES
        allowed = {t.format("mytok mytok1") for t in templates}
        assert set(captions) <= allowed and len(set(captions)) > 1  # drawn per sample


def test_generate_loads_an_sdxl_embedding(tmp_path):
    from tools.generate import build_parser as generate_parser
    from tools.generate import load_model, options_from_args, run

    g = torch.Generator().manual_seed(0)
    emb = {"clip_l": torch.randn(2, 32, generator=g), "clip_g": torch.randn(2, 64, generator=g)}
    save_file(emb, str(tmp_path / "emb.safetensors"), metadata={"ss_token_string": "mytok"})
    o = options_from_args(generate_parser().parse_args([
        "--ckpt", "tiny:sdxl", "--sdxl", "--outdir", str(tmp_path / "gen"), "--prompt", "a mytok --w 64 --h 64 --s 1",
        "--textual_inversion_embeddings", str(tmp_path / "emb.safetensors")]))
    family, components, device = loaded = load_model(o)
    assert len(run(o, loaded)) == 1
    for i, key in enumerate(("clip_l", "clip_g")):  # the recorded token, in both encoders
        ids = components.tokenizers[i].convert_tokens_to_ids(["mytok", "mytok1"])
        rows = components.text_encoders[i].get_input_embeddings()(torch.tensor([ids]))[0]
        assert torch.equal(rows, emb[key])


def test_web_ui_generation_of_a_textual_inversion_job(tmp_path):
    """The Generate tab of a textual-inversion job: the base model with the chosen embedding."""
    from webui.generation import generate_command
    from webui.jobfiles import JobFolder

    folder = JobFolder(str(tmp_path), 1)
    config = {"model": {"pretrained_model_name_or_path": "tiny:sd1"}, "textual_inversion": {"token_string": "t"}}
    argv = generate_command(folder, "textual_inversion", config, "p.txt", "out/t.safetensors", None, None, None, None)
    assert argv[2:6] == ["--ckpt", "tiny:sd1", "--textual_inversion_embeddings", "out/t.safetensors"]
    argv = generate_command(folder, "textual_inversion", config, "p.txt", None, None, None, None, None)
    assert argv[2:4] == ["--ckpt", "tiny:sd1"] and "--textual_inversion_embeddings" not in argv


def test_diffusers_loads_our_sdxl_embedding(tmp_path):
    """diffusers' documented SDXL way: clip_l into text_encoder, clip_g into text_encoder_2."""
    from diffusers import StableDiffusionXLPipeline

    from library.families.sdxl.saving import write_sdxl_preset

    data = make_dataset(str(tmp_path / "data"), n=1)
    saved = load_file(ti_trainer(ti_args(data, str(tmp_path / "out"), preset="tiny:sdxl"), "sdxl").run())
    write_sdxl_preset("tiny:sdxl", str(tmp_path / "pipe"), single_file=False)
    pipe = StableDiffusionXLPipeline.from_pretrained(str(tmp_path / "pipe"))
    pairs = ((pipe.tokenizer, pipe.text_encoder, "clip_l"), (pipe.tokenizer_2, pipe.text_encoder_2, "clip_g"))
    for tokenizer, encoder, key in pairs:
        pipe.load_textual_inversion(saved[key], token=["mytok", "mytok1"], text_encoder=encoder, tokenizer=tokenizer)
    for tokenizer, encoder, key in pairs:
        rows = encoder.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(["mytok", "mytok1"])]
        assert torch.equal(rows, saved[key].to(rows.dtype))
