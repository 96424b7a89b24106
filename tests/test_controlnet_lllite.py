"""ControlNet-LLLite (networks/control_net_lllite.py, sdxl_train_control_net_lllite.py): sd-scripts' module names and
file layout, loading back, the UNet's output, training and generation on tiny:sdxl."""

from __future__ import annotations

import collections
import re

import pytest
import torch
from safetensors import safe_open

from library.core.errors import ConfigError, UserError
from library.families.sdxl.configs import build_sdxl_modules
from library.families.sdxl.lora_names import sgm_module_path
from networks import control_net_lllite as lllite


def golden_module_names() -> list[str]:
    """sd-scripts' rule on SDXL: attn1 q/k/v and attn2 q of every transformer block of input blocks 4, 5 (2 blocks
    each), 7, 8 and the middle block (10 each); output blocks skipped."""
    blocks = [("input_blocks_4_1", 2), ("input_blocks_5_1", 2), ("input_blocks_7_1", 10), ("input_blocks_8_1", 10),
              ("middle_block_1", 10)]
    return [f"lllite_unet_{block}_transformer_blocks_{i}_{layer}"
            for block, n in blocks for i in range(n) for layer in ("attn1_to_q", "attn1_to_k", "attn1_to_v",
                                                                  "attn2_to_q")]


KEY_RULE = re.compile(r"^lllite_unet_(input_blocks_[4578]_1|middle_block_1)_transformer_blocks_\d_"
                      r"(attn1_to_[qkv]|attn2_to_q)\.(conditioning1\.[0246]|down\.0|mid\.0|up\.0)\.(weight|bias)$")


def network(unet, cond_emb_dim=32, mlp_dim=64, **kw) -> lllite.ControlNetLLLite:
    return lllite.ControlNetLLLite(unet, cond_emb_dim, mlp_dim, rename=sgm_module_path, **kw)


def test_tiny_sdxl_gets_sd_scripts_136_modules_by_name(tiny_sdxl):
    net = network(tiny_sdxl.denoiser)
    names = [m.lllite_name for m in net.unet_modules]
    assert len(names) == 136
    assert sorted(names) == sorted(golden_module_names())
    assert collections.Counter(m.depth for m in net.unet_modules) == {2: 16, 3: 120}
    keys = list(net.state_dict())
    # weight + bias of down, mid, up and of the conditioning convs: 2 at depth 2, 3 at depth 3
    assert len(keys) == 16 * (6 + 4) + 120 * (6 + 6) == 1600
    assert all(KEY_RULE.match(k) for k in keys), [k for k in keys if not KEY_RULE.match(k)][:3]


def test_full_size_sdxl_unet_on_meta_has_the_same_names_and_sd_scripts_shapes():
    unet = build_sdxl_modules("random:sdxl", "meta")["unet"]
    net = network(unet)
    assert sorted(m.lllite_name for m in net.unet_modules) == sorted(golden_module_names())
    sd = net.state_dict()
    assert sd["lllite_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.down.0.weight"].shape == (64, 640)
    assert sd["lllite_unet_input_blocks_7_1_transformer_blocks_9_attn2_to_q.up.0.weight"].shape == (1280, 64)
    assert sd["lllite_unet_middle_block_1_transformer_blocks_0_attn1_to_v.mid.0.weight"].shape == (64, 96)
    assert sd["lllite_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.conditioning1.2.weight"].shape == \
        (32, 16, 4, 4)  # depth 2: 4x then 4x
    assert sd["lllite_unet_middle_block_1_transformer_blocks_0_attn1_to_q.conditioning1.4.weight"].shape == \
        (32, 16, 2, 2)  # depth 3: 4x, 4x, then 2x
    # 22,969,600 weights: about 46 MB in fp16, the size of the published cond_emb_dim 32 / mlp 64 SDXL models
    assert sum(p.numel() for p in net.parameters()) == 22_969_600


def test_depth_rule_of_sgm_paths():
    assert lllite.lllite_depth("input_blocks.1.1.transformer_blocks.0.attn1.to_q") == 1
    assert lllite.lllite_depth("input_blocks.4.1.transformer_blocks.1.attn2.to_q") == 2
    assert lllite.lllite_depth("input_blocks.8.1.transformer_blocks.9.attn1.to_v") == 3
    assert lllite.lllite_depth("middle_block.1.transformer_blocks.3.attn1.to_k") == 3
    for skipped in ("output_blocks.0.1.transformer_blocks.0.attn1.to_q",  # output blocks
                    "input_blocks.4.1.transformer_blocks.0.attn2.to_k",  # text-side inputs of cross-attention
                    "input_blocks.4.1.transformer_blocks.0.attn1.to_out.0", "input_blocks.4.1.proj_in",
                    "input_blocks.4.1.transformer_blocks.0.ff.net.2"):
        assert lllite.lllite_depth(skipped) is None, skipped


@pytest.fixture
def unet_inputs(tiny_sdxl):
    g = torch.Generator().manual_seed(0)
    c = tiny_sdxl.denoiser.config
    latents = torch.randn(2, 4, 16, 16, generator=g)
    text = torch.randn(2, 77, c.cross_attention_dim, generator=g)
    added = {"text_embeds": torch.randn(2, 64, generator=g), "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]] * 2)}
    cond = torch.rand(2, 3, 128, 128, generator=g) * 2 - 1
    return latents, text, added, cond


def unet_out(unet, inputs):
    latents, text, added, _ = inputs
    with torch.no_grad():
        return unet(latents, torch.tensor([500, 20]), text, added_cond_kwargs=added).sample


def test_unet_output_is_the_plain_unets_at_zero_output_and_multiplier_0(tiny_sdxl, unet_inputs):
    unet = tiny_sdxl.denoiser
    plain = unet_out(unet, unet_inputs)
    net = network(unet)
    net.apply_to()
    try:
        net.set_cond_image(unet_inputs[3])
        # as sd-scripts, only up's weight starts at zero: its bias is nn.Linear's default, so a new network
        # already moves the output (a little)
        assert not torch.equal(unet_out(unet, unet_inputs), plain)
        with torch.no_grad():
            for m in net.unet_modules:
                m.up[0].bias.zero_()
        assert torch.equal(unet_out(unet, unet_inputs), plain)  # x + 0 is x: bitwise
        with torch.no_grad():
            for m in net.unet_modules:
                torch.nn.init.normal_(m.up[0].weight, std=0.1)
        trained = unet_out(unet, unet_inputs)
        assert (trained - plain).abs().max() > 1e-3
        net.set_multiplier(0.0)
        assert torch.equal(unet_out(unet, unet_inputs), plain)
        net.set_multiplier(1.0)
        net.set_cond_image(None)
        assert torch.equal(unet_out(unet, unet_inputs), plain)
    finally:
        net.restore()
    assert torch.equal(unet_out(unet, unet_inputs), plain)


def test_module_forward_is_sd_scripts_formula():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 5)
    module = lllite.LLLiteModule("m", linear, 1, cond_emb_dim=4, mlp_dim=6)
    torch.nn.init.normal_(module.up[0].weight)
    module.apply_to()
    cond = torch.rand(1, 3, 16, 16) * 2 - 1
    module.set_cond_image(cond)
    x = torch.randn(2, 4, 8)  # a CFG batch of one conditioning image: (uncond, cond)
    with torch.no_grad():
        got = linear(x)
        emb = module.conditioning1(cond).flatten(2).permute(0, 2, 1).repeat(2, 1, 1)  # (1, 4 tokens, 4) -> (2, ...)
        h = torch.relu(module.mid[0](torch.cat([emb, torch.relu(module.down[0](x))], dim=2)))
        want = torch.nn.functional.linear(x + module.up[0](h), linear.weight, linear.bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_saved_file_has_sd_scripts_keys_and_loads_back(tiny_sdxl, tmp_path):
    net = network(tiny_sdxl.denoiser)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    path = str(tmp_path / "lllite.safetensors")
    net.save_weights(path, torch.float16, {"modelspec.architecture": "stable-diffusion-xl-v1-base",
                                           "ss_network_dim": "64"})
    with safe_open(path, "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        dtypes = {f.get_tensor(k).dtype for k in keys}
    assert keys == set(net.state_dict())
    assert dtypes == {torch.float16}
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/control-net-lllite"  # as sd-scripts
    assert "sshs_model_hash" in meta
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically

    other = network(tiny_sdxl.denoiser)
    other.load_weights(path)
    for key, value in net.state_dict().items():
        assert torch.equal(other.state_dict()[key], value.half().float()), key
    rebuilt, weights = lllite.create_network_from_weights(1.0, path, None, None, tiny_sdxl.denoiser,
                                                          lora_targets=[_unet_target(tiny_sdxl.denoiser)])
    assert (rebuilt.cond_emb_dim, rebuilt.mlp_dim) == (32, 64)  # read from the tensors, as ComfyUI's loader
    assert [lllite.depth_of_weights(weights, m.lllite_name) for m in rebuilt.unet_modules] == \
        [m.depth for m in net.unet_modules]


def _unet_target(unet):
    from networks.lora_targets import LoraTarget

    return LoraTarget("lora_unet", unet, ("Transformer2DModel",), rename=sgm_module_path)


def test_a_file_of_other_dims_is_refused_by_name(tiny_sdxl, tmp_path):
    path = str(tmp_path / "small.safetensors")
    network(tiny_sdxl.denoiser, cond_emb_dim=16, mlp_dim=8).save_weights(path, None, None)
    with pytest.raises(UserError, match=r"--network_weights .*small.safetensors: lllite_unet_input_blocks_4_1_"
                                         r"transformer_blocks_0_attn1_to_k.conditioning1.0.bias has shape \[8\] in "
                                         r"the file but \[16\] here; use the file's --cond_emb_dim"):
        network(tiny_sdxl.denoiser).load_weights(path)


def test_create_network_arguments_are_checked(tiny_sdxl):
    targets = [_unet_target(tiny_sdxl.denoiser)]
    with pytest.raises(ConfigError, match="--cond_emb_dim: required"):
        lllite.create_network(1.0, 64, 1, None, None, tiny_sdxl.denoiser, lora_targets=targets)
    with pytest.raises(ConfigError, match="cond_emb_dim=7: expected a positive even integer"):
        lllite.create_network(1.0, 64, 1, None, None, tiny_sdxl.denoiser, lora_targets=targets, cond_emb_dim="7")
    with pytest.raises(ConfigError, match="conv_dim: not an argument of ControlNet-LLLite"):
        lllite.create_network(1.0, 64, 1, None, None, tiny_sdxl.denoiser, lora_targets=targets, cond_emb_dim="32",
                              conv_dim="4")
    net = lllite.create_network(1.0, 8, 1, None, None, tiny_sdxl.denoiser, neuron_dropout=0.1, lora_targets=targets,
                                cond_emb_dim="16")
    assert (net.cond_emb_dim, net.mlp_dim, net.unet_modules[0].dropout) == (16, 8, 0.1)


# --- generation (tools/generate.py --lllite --control_image) -------------------------------------------------------

@pytest.fixture(scope="module")
def lllite_file(tmp_path_factory):
    """A LLLite file for tiny:sdxl with random (non-zero) weights everywhere."""
    unet = build_sdxl_modules("tiny:sdxl")["unet"]
    net = network(unet, cond_emb_dim=16, mlp_dim=8)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = str(tmp_path_factory.mktemp("lllite") / "toy_lllite.safetensors")
    net.save_weights(path, None, None)
    return path


def control_png(path, seed):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, size=(48, 80, 3), dtype=np.uint8)).save(path)  # not the image's size
    return str(path)


def generated(tmp_path, name, *extra):
    import numpy as np
    from PIL import Image
    from tools import generate as tool

    out = tmp_path / name
    argv = ["--ckpt", "tiny:sdxl", "--sdxl", "--outdir", str(out), "--prompt", "a red cat --n blurry --d 5",
            "--device", "cpu", "--W", "64", "--H", "64", "--steps", "2", "--scale", "4", "--sampler", "euler_a", *extra]
    assert tool.main(argv) == 0
    (path,) = sorted(out.glob("*.png"))
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def test_generate_with_lllite_follows_the_control_image(tmp_path, lllite_file):
    plain = generated(tmp_path, "plain")
    a = generated(tmp_path, "a", "--lllite", lllite_file, "--control_image", control_png(tmp_path / "a.png", 0))
    a_again = generated(tmp_path, "a2", "--network_weights", lllite_file,  # the module is found from the keys
                        "--control_image", str(tmp_path / "a.png"))
    b = generated(tmp_path, "b", "--lllite", lllite_file, "--control_image", control_png(tmp_path / "b.png", 1))
    off = generated(tmp_path, "off", "--lllite", lllite_file, "--lllite_mul", "0",
                    "--control_image", str(tmp_path / "a.png"))
    by_prompt = generated(tmp_path, "cn", "--lllite", lllite_file, "--prompt",
                          f"a red cat --n blurry --d 5 --cn {tmp_path / 'a.png'}")  # the prompt's own --cn
    assert a.shape == (64, 64, 3)
    assert (a == a_again).all() and (a == by_prompt).all()
    assert abs(a - plain).max() > 10 and abs(a - b).max() > 10
    assert (off == plain).all()  # multiplier 0: the plain model's image


def test_generate_lllite_without_a_control_image_is_refused(tmp_path, lllite_file, capsys):
    from tools import generate as tool

    code = tool.main(["--ckpt", "tiny:sdxl", "--sdxl", "--outdir", str(tmp_path), "--prompt", "a cat",
                      "--lllite", lllite_file])
    assert code != 0
    assert "--lllite " + lllite_file + ": every prompt needs a control image" in capsys.readouterr().err


# --- training (sdxl_train_control_net_lllite.py) ---------------------------------------------------------------------

def lllite_pairs(root) -> tuple[str, str]:
    """root/train/2_toy with 4 images (two buckets) and captions; root/cond with an edge-like image of each."""
    import os

    import numpy as np
    from PIL import Image

    folder, cond = os.path.join(root, "train", "2_toy"), os.path.join(root, "cond")
    os.makedirs(folder)
    os.makedirs(cond)
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(64, 64), (128, 64), (64, 64), (128, 64)]):
        img = rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)
        Image.fromarray(img).save(os.path.join(folder, f"im{i}.png"))
        Image.fromarray(np.where(img > 128, 255, 0).astype(np.uint8)).save(os.path.join(cond, f"im{i}.png"))
        with open(os.path.join(folder, f"im{i}.txt"), "w") as f:
            f.write(f"toy {i}")
    return os.path.join(root, "train"), cond


def lllite_argv(train, cond, out, steps=2, extra=()):
    return ["--pretrained_model_name_or_path", "tiny:sdxl", "--train_data_dir", train, "--conditioning_data_dir", cond,
            "--caption_extension", ".txt", "--resolution", "64", "--enable_bucket", "--min_bucket_reso", "64",
            "--max_bucket_reso", "128", "--train_batch_size", "1", "--max_data_loader_n_workers", "0",
            "--cond_emb_dim", "16", "--network_dim", "8", "--learning_rate", "1e-3", "--optimizer_type", "AdamW",
            "--max_train_steps", str(steps), "--seed", "7", "--output_dir", out, "--output_name", "lllite",
            "--save_model_as", "safetensors", *extra]


def run_lllite(argv) -> int:
    from library.cli.entry import run_training

    return run_training("sdxl", "test", argv, lllite=True)


def test_train_two_steps_saves_an_sd_scripts_lllite_file_that_loads_back(tmp_path, tiny_sdxl):
    train, cond = lllite_pairs(str(tmp_path))
    out = str(tmp_path / "out")
    assert run_lllite(lllite_argv(train, cond, out)) == 0
    path = tmp_path / "out" / "lllite.safetensors"
    with safe_open(str(path), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        saved = {k: f.get_tensor(k) for k in keys}
    assert keys == {f"{name}.{rest}" for name in golden_module_names() for rest in _tensor_names(name)}
    assert meta["ss_network_module"] == "networks.control_net_lllite"
    assert meta["modelspec.architecture"].endswith("/control-net-lllite")
    # the zero-initialised up weights trained: the conditioning reached the loss
    assert all(saved[k].abs().max() > 0 for k in keys if k.endswith(".up.0.weight"))
    net = lllite.create_network_from_weights(1.0, str(path), None, None, tiny_sdxl.denoiser,
                                             lora_targets=[_unet_target(tiny_sdxl.denoiser)])[0]
    net.load_weights(str(path))
    assert all(torch.equal(net.state_dict()[k], v) for k, v in saved.items())

    # continued from the file (--network_weights): one SGD step at 1e-30 (far below a float's resolution at these
    # magnitudes) gives the file's weights back, where a fresh start would not
    again = str(tmp_path / "again")
    assert run_lllite(lllite_argv(train, cond, again, steps=1, extra=["--network_weights", str(path),
                                                                      "--optimizer_type", "SGD",
                                                                      "--learning_rate", "1e-30"])) == 0
    with safe_open(str(tmp_path / "again" / "lllite.safetensors"), "pt") as f:
        for k, v in saved.items():
            torch.testing.assert_close(f.get_tensor(k), v, rtol=0, atol=1e-25)


def _tensor_names(name: str) -> list[str]:
    convs = (0, 2, 4) if name.startswith(("lllite_unet_input_blocks_7", "lllite_unet_input_blocks_8",
                                          "lllite_unet_middle")) else (0, 2)
    layers = [f"conditioning1.{i}" for i in convs] + ["down.0", "mid.0", "up.0"]
    return [f"{layer}.{p}" for layer in layers for p in ("weight", "bias")]


def test_bad_lllite_command_lines_are_one_line_errors(tmp_path, capsys):
    train, cond = lllite_pairs(str(tmp_path))
    argv = lllite_argv(train, cond, str(tmp_path / "out"))
    i = argv.index("--cond_emb_dim")
    assert run_lllite(argv[:i] + argv[i + 2:]) == 2
    assert "--cond_emb_dim: required for ControlNet-LLLite" in capsys.readouterr().err
    assert run_lllite(argv + ["--network_module", "networks.lora_fa"]) == 2
    assert "sdxl_train_control_net_lllite.py trains networks.control_net_lllite only" in capsys.readouterr().err
    i = argv.index("--conditioning_data_dir")
    assert run_lllite(argv[:i] + argv[i + 2:]) == 2
    assert "needs conditioning_data_dir" in capsys.readouterr().err


def test_web_ui_template_is_a_job_the_lllite_script_checks(tmp_path, capsys):
    """webui/templates/sdxl_controlnet_lllite.toml: the sdxl family's controlnet_lllite script; its config and
    dataset, on the tiny model with example pairs, pass the script's own --check_config."""
    import toml

    from library.families import get_family
    from webui.jobfiles import templates

    t = templates()["sdxl_controlnet_lllite"]
    assert (t["template"]["family"], t["template"]["mode"]) == ("sdxl", "controlnet_lllite")
    assert get_family("sdxl").scripts["controlnet_lllite"] == "sdxl_train_control_net_lllite.py"
    train, cond = lllite_pairs(str(tmp_path))
    config = {section: dict(values) for section, values in t["config"].items()}
    config["model"]["pretrained_model_name_or_path"] = "tiny:sdxl"
    config["optimizer"]["optimizer_type"] = "AdamW"
    config["output"].update(output_dir=str(tmp_path / "out"), logging_dir=str(tmp_path / "logs"))  # the job's folders
    config["training"]["mixed_precision"] = "no"
    dataset = t["dataset"]
    dataset["datasets"][0].update(resolution=64, min_bucket_reso=64, max_bucket_reso=128)
    dataset["datasets"][0]["subsets"][0].update(image_dir=str(tmp_path / "train" / "2_toy"), conditioning_data_dir=cond)
    (tmp_path / "dataset.toml").write_text(toml.dumps(dataset))
    config["model"]["dataset_config"] = str(tmp_path / "dataset.toml")
    (tmp_path / "config.toml").write_text(toml.dumps(config))
    assert run_lllite(["--config_file", str(tmp_path / "config.toml"), "--check_config"]) == 0, capsys.readouterr().err
    assert "config ok" in capsys.readouterr().out
    dataset["datasets"][0]["subsets"][0].pop("conditioning_data_dir")
    (tmp_path / "dataset.toml").write_text(toml.dumps(dataset))
    assert run_lllite(["--config_file", str(tmp_path / "config.toml"), "--check_config"]) == 2
    assert "needs conditioning_data_dir" in capsys.readouterr().err


def test_resumed_lllite_run_equals_the_uninterrupted_run(tmp_path):
    """2 steps with --save_state, then --resume for steps 3-4: the same LLLite file as 4 steps at once, bitwise
    (the conditioning images of the resumed batches are those the uninterrupted run saw)."""
    import os

    from safetensors.torch import load_file

    train, cond = lllite_pairs(str(tmp_path))

    def run(out: str, steps: int, *more: str) -> dict:
        assert run_lllite(lllite_argv(train, cond, str(tmp_path / out), steps=steps, extra=more)) == 0
        return load_file(str(tmp_path / out / "lllite.safetensors"))

    straight = run("straight", 4)
    run("split", 2, "--save_state")
    state = os.path.join(str(tmp_path / "split"), "lllite-state")
    assert os.path.isdir(state), os.listdir(tmp_path / "split")
    resumed = run("split", 4, "--resume", state)
    assert straight.keys() == resumed.keys() and len(straight) == 1600
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []
    assert all(v.abs().max() > 0 for k, v in straight.items() if k.endswith(".up.0.weight"))  # it trained


def test_ddp_two_processes_agree_on_the_lllite_weights(tmp_path):
    """torchrun, 2 CPU processes (gloo): each trains on its own share of the pairs, the gradients are averaged, so
    both hold the same LLLite weights after every step; only rank 0 writes the file."""
    import os

    from tests.distributed_helpers import TORCHRUN, launch, read_trace

    if TORCHRUN is None:
        pytest.skip("torchrun not installed")
    tmp = str(tmp_path)
    train, cond = lllite_pairs(tmp)
    out, logs = os.path.join(tmp, "out"), os.path.join(tmp, "logs")
    argv = lllite_argv(train, cond, out, steps=3, extra=["--cpu", "--logging_dir", logs])
    launch(tmp, 1, argv, timeout=400, env_extra={"SCRIPT": "sdxl_train_control_net_lllite.py"})
    trace = read_trace(tmp)
    assert [t["step"] for t in trace[0]] == [t["step"] for t in trace[1]] == [1, 2, 3]
    assert [t["params"] for t in trace[0]] == [t["params"] for t in trace[1]]  # the same weights on both
    assert all(len(t["images"]) == 1 for r in (0, 1) for t in trace[r])  # each its own batch of 1 per step
    with safe_open(os.path.join(out, "lllite.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 1600 and f.metadata()["ss_total_batch_size"] == "2"
    with open(os.path.join(tmp, "audit", "writes1.txt")) as f:
        assert f.read() == ""  # rank 1 wrote nothing


def test_sampling_during_lllite_training_uses_each_prompts_cn_image(tmp_path):
    """--sample_every_n_steps between steps whose conditioning images have another size than the samples: a prompt
    with --cn is sampled with that control image, one without it without control (the last batch's images are not
    used)."""
    import numpy as np
    from PIL import Image

    train, cond = lllite_pairs(str(tmp_path))
    prompts = tmp_path / "prompts.txt"
    cn = control_png(tmp_path / "cn.png", 4)
    prompts.write_text(f"a toy --w 64 --h 96 --s 2 --d 1 --cn {cn}\na toy --w 64 --h 96 --s 2 --d 1\n")
    out = tmp_path / "out"
    assert run_lllite(lllite_argv(train, cond, str(out), steps=1, extra=[
        "--sample_prompts", str(prompts), "--sample_every_n_steps", "1", "--sample_sampler", "euler"])) == 0
    samples = sorted(p for p in (out / "sample").glob("*.png") if not p.name.endswith("_grid.png"))
    assert [p.name.split("_")[2] for p in samples] == ["00", "01"]  # step 1: both prompts
    with_cn, without = (np.asarray(Image.open(p).convert("RGB")).astype(int) for p in samples)
    assert abs(with_cn - without).max() > 0  # same seed and prompt: only the control image differs


def test_lllite_trains_with_checkpointing_and_caches(tmp_path):
    """--gradient_checkpointing (the embedding is recomputed with the block), --cache_latents (the conditioning
    images are still read every step) and --cache_text_encoder_outputs (the text encoders never train here)."""
    train, cond = lllite_pairs(str(tmp_path))
    out = tmp_path / "out"
    assert run_lllite(lllite_argv(train, cond, str(out), steps=2, extra=[
        "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs"])) == 0
    with safe_open(str(out / "lllite.safetensors"), "pt") as f:
        ups = [f.get_tensor(k) for k in f.keys() if k.endswith(".up.0.weight")]
    assert len(ups) == 136 and all(u.abs().max() > 0 for u in ups)


def test_the_batch_conditioning_images_reach_the_network_in_minus_one_to_one():
    """The batch holds conditioning images in [0, 1]; LLLite (sd-scripts' dataset, ComfyUI's loader) takes [-1, 1]."""
    from library.train.adapters.trainables import AdapterTrainable

    got = []

    class Network:
        def set_cond_image(self, image):
            got.append(image)

    trainable = AdapterTrainable.__new__(AdapterTrainable)
    trainable.module = Network()
    images = torch.tensor([0.0, 0.25, 1.0]).view(1, 3, 1, 1)
    trainable.before_predict({"conditioning_images": images})
    assert got[0].flatten().tolist() == [-1.0, -0.5, 1.0]


def test_describe_flags_of_the_lllite_script_has_cond_emb_dim_once(capsys):
    """What the web UI draws its form from: --cond_emb_dim in its own group, every argparse flag described once."""
    import json

    from library.cli.entry import build_parser
    from library.families import get_family

    with pytest.raises(SystemExit) as e:
        run_lllite(["--describe_flags"])
    assert e.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    flags = {f["name"]: f for f in doc["flags"]}
    assert (flags["cond_emb_dim"]["group"], flags["cond_emb_dim"]["type"], flags["cond_emb_dim"]["default"]) == \
        ("ControlNet-LLLite", "int", None)
    parser = build_parser("describe", get_family("sdxl"), lllite=True)
    assert [f["name"] for f in doc["flags"]] == [a.dest for a in parser._actions if a.dest != "help"]


def test_web_ui_generates_an_lllite_job_with_its_file_as_lllite(tmp_path):
    from webui.generation import generate_command
    from webui.jobfiles import JobFolder

    folder = JobFolder(str(tmp_path), 1)
    config = {"model": {"pretrained_model_name_or_path": "/models/sdxl.safetensors"}}
    argv = generate_command(folder, "controlnet_lllite", config, "p.txt", "/jobs/1/output/x.safetensors", None, None,
                            None, None)
    assert argv[2:6] == ["--ckpt", "/models/sdxl.safetensors", "--lllite", "/jobs/1/output/x.safetensors"]
