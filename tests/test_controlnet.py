"""The ControlNet scripts (train_control_net.py, sdxl_train_control_net.py, flux_train_control_net.py): 2 steps on
the tiny models, saved files that diffusers loads with exactly the weights trained, resume, refusals before step 1."""

import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from library.cli.entry import run_training
from library.train.trainer import InterruptedTraining
from tests.train_helpers import ft_args

CASES = [("sd", "tiny:sd1"), ("sdxl", "tiny:sdxl"), ("flux", "tiny:flux")]
# What ComfyUI's comfy/controlnet.py tells the single-file layouts by (diffusers SD/SDXL; InstantX FLUX.1).
COMFY_MARKER = {"sd": "controlnet_cond_embedding.conv_in.weight", "sdxl": "controlnet_cond_embedding.conv_in.weight",
                "flux": "controlnet_x_embedder.weight"}


def _pairs(root: str, n: int = 2) -> tuple[str, str]:
    """root/train/1_toy/img<i>.png (+ .txt) and root/cond/img<i>.png: a square and its edges."""
    folder, cond = os.path.join(root, "train", "1_toy"), os.path.join(root, "cond")
    os.makedirs(folder)
    os.makedirs(cond)
    for i in range(n):
        img = np.full((64, 64, 3), 40 * i, np.uint8)
        img[16:48, 16:48] = 220
        Image.fromarray(img).save(os.path.join(folder, f"img{i}.png"))
        edges = np.zeros((64, 64, 3), np.uint8)
        edges[16:48, 16] = edges[16:48, 47] = edges[16, 16:48] = edges[47, 16:48] = 255
        Image.fromarray(edges).save(os.path.join(cond, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(f"a square {i}")
    return os.path.join(root, "train"), cond


def _argv(data: str, cond: str, out: str, preset: str, steps: int = 2, extra=()) -> list[str]:
    argv = ft_args(data, out, preset=preset, steps=steps)
    argv[argv.index("--output_name") + 1] = "cn"
    return argv + ["--conditioning_data_dir", cond, *extra]


def _trainer(family: str, argv: list[str]):
    from library.cli.entry import settings_from_args
    from library.cli.config_file import parse_with_config_file
    from library.cli.parser import build_parser
    from library.families import get_family
    from library.train.trainer import Trainer

    fam = get_family(family)
    ns = parse_with_config_file(build_parser("test", fam, fine_tune=True, controlnet=True), argv)
    return Trainer(fam, settings_from_args(ns, fam, fine_tune=True, controlnet=True))


@pytest.mark.parametrize("family,preset", CASES)
def test_trains_two_steps_and_diffusers_loads_the_folder_with_the_trained_weights(tmp_path, family, preset):
    from diffusers import ControlNetModel, FluxControlNetModel

    data, cond = _pairs(str(tmp_path))
    out = str(tmp_path / "out")
    trainer = _trainer(family, _argv(data, cond, out, preset, extra=["--save_model_as", "diffusers_safetensors",
                                                                     "--save_state"]))
    assert trainer.run() == os.path.join(out, "cn")
    controlnet = trainer.components.controlnet
    # the base model stayed frozen; only the ControlNet has gradients
    assert not any(p.requires_grad for p in trainer.components.denoiser.parameters())
    assert all(p.requires_grad for p in controlnet.parameters())
    cls = FluxControlNetModel if family == "flux" else ControlNetModel
    loaded = cls.from_pretrained(os.path.join(out, "cn"))
    state = load_file(os.path.join(out, "cn-state", "model.safetensors"))
    ours = loaded.state_dict()
    assert sorted(state) == sorted(f"controlnet.{k}" for k in ours) and len(ours) > 50
    assert all(torch.equal(ours[k], state[f"controlnet.{k}"]) for k in ours)  # bitwise what was trained
    assert all(torch.equal(ours[k], v.detach().cpu()) for k, v in controlnet.state_dict().items())
    # Training moved it: the zero-initialised output convolutions are no longer zero.
    zero_convs = [k for k in ours if k.startswith(("controlnet_down_blocks", "controlnet_blocks"))]
    assert zero_convs and any(ours[k].abs().sum() > 0 for k in zero_convs)
    # the folder is loadable into the base model's pipeline: the residuals fit the denoiser
    assert COMFY_MARKER[family] in ours


def test_single_file_resume_and_continue_from_it(tmp_path):
    """SD: the default .safetensors (diffusers names, as ComfyUI reads it) equals the trained weights; a run stopped
    at step 2 and resumed equals the uninterrupted one bitwise; --controlnet_model_name_or_path starts from it."""
    from diffusers import ControlNetModel

    data, cond = _pairs(str(tmp_path))
    straight = run_training("sd", "t", _argv(data, cond, str(tmp_path / "a"), "tiny:sd1", steps=4), controlnet=True)
    assert straight == 0
    a = load_file(str(tmp_path / "a" / "cn.safetensors"))
    assert COMFY_MARKER["sd"] in a
    out = str(tmp_path / "b")
    first = _trainer("sd", _argv(data, cond, out, "tiny:sd1", steps=4, extra=["--save_state"]))

    def stop_at_2(trainer, event, step):
        if event == "step" and step == 2:
            trainer._on_signal(15, None)

    first.s.hooks.append(stop_at_2)
    with pytest.raises(InterruptedTraining):
        first.run()
    resumed = _trainer("sd", _argv(data, cond, out, "tiny:sd1", steps=4, extra=["--resume", "auto"])).run()
    b = load_file(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The single file loads into diffusers' ControlNetModel (strict) with the config from_unet gives.
    trainer = _trainer("sd", _argv(data, cond, str(tmp_path / "c"), "tiny:sd1", steps=1, extra=[
        "--controlnet_model_name_or_path", str(tmp_path / "a" / "cn.safetensors"), "--learning_rate", "0"]))
    trainer.run()
    model = ControlNetModel.from_unet(trainer.components.denoiser)
    model.load_state_dict(a, strict=True)
    # lr 0: the continued run starts from (and keeps) the file's weights exactly
    assert all(torch.equal(v.cpu(), a[k]) for k, v in trainer.components.controlnet.state_dict().items())


def test_missing_pair_and_missing_folder_are_named_before_step_1(tmp_path, capsys):
    data, cond = _pairs(str(tmp_path))
    os.remove(os.path.join(cond, "img1.png"))
    out = str(tmp_path / "out")
    assert run_training("sd", "t", _argv(data, cond, out, "tiny:sd1"), controlnet=True) == 2
    err = capsys.readouterr().err
    assert f"{data}/1_toy/img1.png: no conditioning image with the same name in {cond}" in err
    assert not os.path.exists(os.path.join(out, "cn.safetensors"))
    argv = _argv(data, cond, out, "tiny:sd1")
    i = argv.index("--conditioning_data_dir")
    del argv[i:i + 2]
    assert run_training("sd", "t", argv, controlnet=True) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --conditioning_data_dir: required with --train_data_dir (the conditioning images, named as the "
        "training images), or set conditioning_data_dir in the --dataset_config subsets")
    assert run_training("sd", "t", _argv(data, cond, out, "tiny:sd1", extra=["--train_text_encoder"]),
                        controlnet=True) == 2
    assert "--train_text_encoder: the ControlNet scripts train the ControlNet only" in capsys.readouterr().err


def test_webui_templates_run_the_controlnet_scripts_and_pass_their_check(tmp_path, monkeypatch):
    """A job from each ControlNet template runs its family's ControlNet script, and (tiny model, the example images
    as their own conditioning images) saving passes that script's --check_config."""
    from fastapi.testclient import TestClient

    from webui import performance
    from webui.jobfiles import REPO_ROOT
    from webui.app import create_app

    flags = frozenset(o[0] for o in performance.OPTIONS) | set(performance.MEMORY_FLAGS)
    monkeypatch.setattr(performance, "trainer_flags", lambda script, timeout=120: flags)
    c = TestClient(create_app(str(tmp_path / "jobs"), find_gpus=list, data_roots=[REPO_ROOT, "/models"]))
    scripts = {"sd": "train_control_net.py", "sdxl": "sdxl_train_control_net.py", "flux": "flux_train_control_net.py"}
    for family, script in scripts.items():
        r = c.post("/api/jobs", json={"template": f"{family}_controlnet"})
        assert r.status_code == 201, r.text
        job = r.json()
        assert (job["family"], job["script"]) == (family, script)
        settings = c.get(f"/api/jobs/{job['id']}/settings").json()
        model = settings["config"]["model"]
        model.update({k: "" for k, v in model.items() if isinstance(v, str) and v.startswith("/models/")})
        model["pretrained_model_name_or_path"] = f"tiny:{family}"
        settings["config"]["optimizer"]["optimizer_type"] = "AdamW"
        subset = settings["dataset"]["datasets"][0]["subsets"][0]
        subset["image_dir"] = "examples/data/train/10_sks shape"
        del subset["conditioning_data_dir"]
        r = c.put(f"/api/jobs/{job['id']}/settings", json=settings)  # the script's own check refuses it
        assert r.status_code == 422 and "needs conditioning_data_dir" in r.json()["detail"]["error"], r.text
        subset["conditioning_data_dir"] = "examples/data/train/10_sks shape"
        r = c.put(f"/api/jobs/{job['id']}/settings", json=settings)
        assert r.status_code == 200, (family, r.text)


def test_canny_tool_writes_the_edges_of_an_image_and_of_a_folder(tmp_path, capsys):
    cv2 = pytest.importorskip("cv2")
    from tools.canny import main

    img = np.zeros((64, 64, 3), np.uint8)
    img[16:48, 16:48] = 255
    os.makedirs(tmp_path / "in")
    Image.fromarray(img).save(tmp_path / "in" / "a.png")
    assert main(["--input", str(tmp_path / "in" / "a.png"), "--output", str(tmp_path / "a_edges.png")]) == 0
    edges = np.asarray(Image.open(tmp_path / "a_edges.png"))
    expected = cv2.Canny(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY), 32, 224)
    assert edges.shape == (64, 64) and np.array_equal(edges, expected)
    ys, xs = np.nonzero(edges)  # white edges on black, only around the square's outline (rows / columns 15..48)
    assert set(np.unique(edges).tolist()) == {0, 255} and len(ys) > 64
    assert ys.min() >= 15 and ys.max() <= 48 and xs.min() >= 15 and xs.max() <= 48 and not edges[20:44, 20:44].any()
    assert main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "cond")]) == 0
    assert os.listdir(tmp_path / "cond") == ["a.png"]
    capsys.readouterr()
    assert main(["--input", str(tmp_path / "nope.png"), "--output", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == f"error: --input {tmp_path / 'nope.png'}: not found\n"


def test_generate_with_a_control_image_uses_the_controlnet(tmp_path):
    """tools/generate.py --control_net --control_image: the ControlNet's residuals change the image (a ControlNet
    with non-zero output convolutions), and without --control_net the same seed gives the plain model's image."""
    from tools.generate import build_parser, options_from_args, run

    data, cond = _pairs(str(tmp_path))
    trainer = _trainer("sd", _argv(data, cond, str(tmp_path / "out"), "tiny:sd1", steps=1))
    trainer.run()
    controlnet = trainer.components.controlnet
    with torch.no_grad():  # outputs far from zero, so the residuals must show in the image
        for name, p in controlnet.named_parameters():
            if name.startswith(("controlnet_down_blocks", "controlnet_mid_block")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
    controlnet.save_pretrained(str(tmp_path / "cn_dir"), safe_serialization=True)
    control = os.path.join(cond, "img0.png")
    common = ["--ckpt", "tiny:sd1", "--W", "64", "--H", "64", "--steps", "3", "--seed", "7", "--scale", "1"]
    paths = {}
    for name, extra in (("plain", []), ("control", ["--control_net", str(tmp_path / "cn_dir"), "--control_image", control]),
                        ("prompt_cn", ["--control_net", str(tmp_path / "cn_dir")])):
        prompt = "a square" + (f" --cn {control}" if name == "prompt_cn" else "")
        o = options_from_args(build_parser().parse_args(common + ["--outdir", str(tmp_path / name), "--prompt", prompt,
                                                                  *extra]))
        (paths[name],) = run(o)
    img = {k: np.asarray(Image.open(v)).astype(int) for k, v in paths.items()}
    assert img["control"].shape == (64, 64, 3)
    assert np.abs(img["control"] - img["plain"]).mean() > 5  # measured: 11.0 grey levels apart
    assert np.array_equal(img["control"], img["prompt_cn"])  # --cn in the prompt = --control_image
    with pytest.raises(Exception, match="every prompt needs a control image"):
        options_from_args(build_parser().parse_args(common + ["--outdir", "x", "--prompt", "a",
                                                              "--control_net", str(tmp_path / "cn_dir")]))


def test_sample_prompts_take_a_control_image_with_cn(tmp_path):
    """--sample_prompts during ControlNet training: a prompt's --cn is the ControlNet's image (sd-scripts' option)."""
    data, cond = _pairs(str(tmp_path))
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"a square --w 64 --h 64 --s 2 --d 1 --cn {cond}/img0.png\n")
    out = str(tmp_path / "out")
    assert run_training("sd", "t", _argv(data, cond, out, "tiny:sd1", steps=1, extra=[
        "--sample_prompts", str(prompts), "--sample_every_n_steps", "1"]), controlnet=True) == 0
    samples = sorted(n for n in os.listdir(os.path.join(out, "sample")) if not n.endswith("_grid.png"))
    assert len(samples) == 1 and Image.open(os.path.join(out, "sample", samples[0])).size == (64, 64)
    prompts.write_text("a square --cn nope.png\n")
    assert run_training("sd", "t", _argv(data, cond, out, "tiny:sd1", steps=1, extra=[
        "--sample_prompts", str(prompts)]), controlnet=True) == 2


def test_two_ddp_processes_train_and_resume(tmp_path):
    """train_control_net.py under torchrun (2 CPU processes, gloo): trains, saves once (rank 0), and a run resumed
    from its step-2 state ends with the weights of the uninterrupted 4-step run, bitwise."""
    from tests.distributed_helpers import TORCHRUN, launch

    if TORCHRUN is None:
        pytest.skip("torchrun not installed")
    tmp = str(tmp_path)
    data, cond = _pairs(tmp, n=4)
    out = os.path.join(tmp, "out")
    argv = _argv(data, cond, out, "tiny:sd1", steps=4, extra=["--cpu", "--save_state", "--save_every_n_steps", "2",
                                                               "--logging_dir", os.path.join(tmp, "logs")])
    launch(tmp, 1, argv, timeout=300, env_extra={"SCRIPT": "train_control_net.py"})
    assert sorted(os.listdir(out)) == ["cn-state", "cn-step00000002-state", "cn-step00000002.safetensors",
                                       "cn.safetensors", "cn_config.toml"]
    resumed = os.path.join(tmp, "resumed")
    argv[argv.index("--output_dir") + 1] = resumed
    launch(tmp, 1, argv + ["--resume", os.path.join(out, "cn-step00000002-state")], timeout=300, trace="trace2",
           env_extra={"SCRIPT": "train_control_net.py"}, audit_roots=[resumed])
    a, b = load_file(os.path.join(out, "cn.safetensors")), load_file(os.path.join(resumed, "cn.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed_zero2"])
def test_sharded_two_processes_equal_one_process_of_batch_2(tmp_path, strategy):
    """FSDP2 (the ControlNet sharded as a fine-tune's part) and DeepSpeed ZeRO-2 (the ControlNet as the trained
    module), 2 CPU processes over gloo: 2 steps of batch 1 x 2 end where 1 process x batch 2 does, up to float
    reordering (measured: 8.8e-11 largest difference for both)."""
    from tests.distributed_helpers import TORCHRUN, launch
    from tests.test_fsdp import FSDP2_ENV

    if TORCHRUN is None:
        pytest.skip("torchrun not installed")
    if strategy == "deepspeed_zero2":
        pytest.importorskip("deepspeed")
    env, flags = (FSDP2_ENV, []) if strategy == "fsdp2" else ({"DS_ACCELERATOR": "cpu"},
                                                             ["--deepspeed", "--zero_stage", "2"])
    tmp = str(tmp_path)
    data, cond = _pairs(tmp, n=4)
    argv = _argv(data, cond, os.path.join(tmp, "out"), "tiny:sd1", extra=["--cpu", "--logging_dir",
                                                                         os.path.join(tmp, "logs"), *flags])
    launch(tmp, 1, argv, timeout=300, env_extra={"SCRIPT": "train_control_net.py", **env})
    one = _argv(data, cond, os.path.join(tmp, "one"), "tiny:sd1")
    one[one.index("--train_batch_size") + 1] = "2"
    assert run_training("sd", "t", one, controlnet=True) == 0
    a, b = load_file(os.path.join(tmp, "out", "cn.safetensors")), load_file(os.path.join(tmp, "one", "cn.safetensors"))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-8


def test_flux_generate_with_a_control_image_uses_the_controlnet(tmp_path):
    """FLUX.1: tools/generate.py --flux --control_net (a FluxControlNetModel folder) --control_image changes the
    image through the transformer's controlnet_block_samples."""
    from diffusers import FluxControlNetModel

    from library.families import get_family
    from library.families.base import LoadOptions
    from tools.generate import build_parser, options_from_args, run

    transformer = get_family("flux").load(LoadOptions("tiny:flux")).denoiser
    cfg = transformer.config
    controlnet = FluxControlNetModel.from_transformer(transformer, num_layers=1, num_single_layers=0,
                                                      attention_head_dim=cfg.attention_head_dim,
                                                      num_attention_heads=cfg.num_attention_heads)
    with torch.no_grad():
        for name, p in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks", "controlnet_x_embedder")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
    controlnet.save_pretrained(str(tmp_path / "cn"))
    _, cond = _pairs(str(tmp_path))
    common = ["--ckpt", "tiny:flux", "--flux", "--W", "64", "--H", "64", "--steps", "2", "--seed", "3",
              "--prompt", "a square"]
    img = {}
    for name, extra in (("plain", []), ("control", ["--control_net", str(tmp_path / "cn"), "--control_image",
                                                    os.path.join(cond, "img0.png")])):
        (path,) = run(options_from_args(build_parser().parse_args(common + ["--outdir", str(tmp_path / name), *extra])))
        img[name] = np.asarray(Image.open(path)).astype(int)
    # measured: 29.9 grey levels apart
    assert img["control"].shape == (64, 64, 3) and np.abs(img["control"] - img["plain"]).mean() > 5
