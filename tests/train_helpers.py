"""Helpers for end-to-end training tests: a tiny dataset and an in-process trainer."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
from PIL import Image

from library.cli.config_file import parse_with_config_file
from library.cli.entry import build_parser, settings_from_args
from library.families import get_family
from library.train.trainer import Trainer


def make_dataset(root: str, n: int = 4, sizes=((64, 64), (128, 64))) -> str:
    """`root/train/5_sks toy` with n coloured images and .txt captions; returns root/train."""
    folder = os.path.join(root, "train", "5_sks toy")
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        base = rng.integers(0, 255, size=3)
        img = np.zeros((h, w, 3), np.uint8) + base.astype(np.uint8)
        img[h // 4: h // 2, w // 4: w // 2] = 255 - base.astype(np.uint8)
        Image.fromarray(img).save(os.path.join(folder, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(f"sks toy, square, color {i}, plain background")
    return os.path.join(root, "train")


def base_args(data_dir: str, out_dir: str, preset: str = "tiny:sd1", steps: int = 6, extra: Optional[list] = None):
    return [
        "--pretrained_model_name_or_path", preset,
        "--train_data_dir", data_dir, "--caption_extension", ".txt",
        "--resolution", "64", "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "128",
        "--train_batch_size", "1", "--max_data_loader_n_workers", "0",
        "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
        "--learning_rate", "1e-3", "--max_train_steps", str(steps), "--seed", "123",
        "--output_dir", out_dir, "--output_name", "lora",
    ] + list(extra or [])


def dataset_config_args(toml: str, out: str, preset: str, steps: int = 2, extra=()) -> list[str]:
    """base_args on a dataset config (`--dataset_config toml`, what an edit dataset needs) instead of a train_data_dir,
    its resolution and buckets."""
    argv = base_args("unused", out, preset, steps=steps, extra=list(extra))
    i = argv.index("--train_data_dir")
    del argv[i:i + 2]
    for flag in ("--resolution", "--enable_bucket", "--min_bucket_reso", "--max_bucket_reso"):
        i = argv.index(flag)
        del argv[i:i + (1 if flag == "--enable_bucket" else 2)]
    return argv + ["--dataset_config", toml]


def make_trainer(argv: list[str], family_name: str = "sd") -> Trainer:
    family = get_family(family_name)
    parser = build_parser("test", family)
    ns = parse_with_config_file(parser, argv)
    return Trainer(family, settings_from_args(ns, family))


def ft_args(data: str, out: str, preset: str = "tiny:sd1", steps: int = 2, extra=()) -> list[str]:
    """base_args for a full fine-tune script: no network flags, output `model`, SGDNesterov at 1e-3."""
    argv = base_args(data, out, preset=preset, steps=steps)
    for flag, n in (("--network_module", 1), ("--network_dim", 1), ("--network_alpha", 1)):
        i = argv.index(flag)
        del argv[i:i + 1 + n]
    argv[argv.index("--output_name") + 1] = "model"
    return argv + ["--learning_rate", "1e-3", "--optimizer_type", "SGDNesterov", *extra]


def ft_trainer(argv: list[str], family_name: str = "sd") -> Trainer:
    """An in-process trainer of the family's full fine-tune script."""
    family = get_family(family_name)
    ns = parse_with_config_file(build_parser("test", family, fine_tune=True), argv)
    return Trainer(family, settings_from_args(ns, family, fine_tune=True))


def random_lora_file(family, components, path: str, seed: int = 0) -> str:
    """A networks.lora file on every text-encoder and denoiser target with random (non-zero) up weights."""
    import torch

    from networks.lora import create_network

    c = components
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in net.text_encoder_loras + net.unet_loras:
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=gen) * 0.2)
    net.save_weights(path, None, {})
    return path


def largest_difference(a, b) -> float:
    """The largest absolute difference between two results of the same shape: tensors, lists of numbers (losses),
    or dicts of tensors with the same keys (a LoRA or model file). NaN anywhere gives NaN."""
    import torch

    if isinstance(a, dict):
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
        assert a, "nothing to compare"
        return torch.tensor([largest_difference(a[k], b[k]) for k in a], dtype=torch.float64).max().item()
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_measured(actual, expected, tolerance: float, what: str) -> float:
    """Two different computations of one result (CPU-offloaded vs plain checkpointing, swapped blocks vs none,
    sharded vs plain, batched vs one by one) agree up to float rounding, which depends on the CPU and its kernels.

    Bitwise equality is for the same ops in the same order (a resumed run, a file read back); here the largest
    absolute difference is printed (pytest -s shows it) and must be at most `tolerance`: 10-100x the figure
    measured, written next to it by the caller, and far below what a real bug gives. Returns the difference."""
    worst = largest_difference(actual, expected)
    print(f"{what}: largest difference {worst:.3g} (tolerance {tolerance:.3g})")
    assert worst <= tolerance, f"{what}: largest difference {worst:.3g} > tolerance {tolerance:.3g}"
    return worst


def largest_lora_up(lora: dict) -> float:
    """How far a networks.lora file trained: its lora_up weights start at 0."""
    return max(v.float().abs().max().item() for k, v in lora.items() if "lora_up" in k)


# --- the single-file DiT families (FLUX.2, Z-Image, Lumina) --------------------------------------------------------

def assert_same_weights(a, b) -> None:
    """Two modules with the same keys and bitwise the same tensors (a file written and read back)."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def fine_tune_one_step(tmp_path, family_name: str, preset: str, extra: list[str], architecture: str,
                       dit_file: str) -> tuple[str, str]:
    """The family's full fine-tune script, one step on one image: the saved model.safetensors records
    `architecture` and has exactly `dit_file`'s keys. Returns (its path, the dataset folder)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from library.cli.entry import run_training

    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    assert run_training(family_name, "test", ft_args(data, out, preset=preset, steps=1, extra=extra),
                        fine_tune=True) == 0
    path = os.path.join(out, "model.safetensors")
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["modelspec.architecture"] == architecture
    assert keys == set(load_file(dit_file))
    return path, data


def assert_only_denoiser_moved(loaded, before) -> None:
    """A fine-tuned model read back: its denoiser (same keys) differs from `before`'s, its text encoder does not."""
    import torch

    a, b = loaded.denoiser.state_dict(), before.denoiser.state_dict()
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    assert_same_weights(loaded.text_encoders[0], before.text_encoders[0])


def assert_lora_changes_generation(tmp_path, ckpt: str, network_module: str, lora_path: str) -> None:
    """tools/generate.py on `ckpt` with the LoRA at --network_mul 0 and 1: one 64x64 image each, and they differ."""
    from tools.generate import main as generate

    images = []
    for mul in ("0", "1"):
        out = tmp_path / f"gen{mul}"
        assert generate(["--ckpt", ckpt, "--network_module", network_module, "--network_weights", lora_path,
                         "--network_mul", mul, "--outdir", str(out), "--prompt", "a red cube", "--W", "64", "--H",
                         "64", "--steps", "2", "--seed", "3"]) == 0
        (name,) = [n for n in os.listdir(out) if n.endswith(".png")]
        images.append(np.asarray(Image.open(out / name)))
    assert images[0].shape == (64, 64, 3) and not np.array_equal(images[0], images[1])


def assert_merged_in_original_layout(merged_file: str, base_file: str, lora_file: str, modules: list[str]) -> None:
    """tools/merge_lora.py's output against the merge computed here on the original file's keys: the same keys, each
    of `modules` (original module paths; kohya name `lora_unet_` + path with `_`) its weight plus
    up @ down · alpha / rank (a fused qkv's up stacks the q, k, v slices over one down), every other tensor as it
    was."""
    import torch
    from safetensors.torch import load_file

    base, got, lora = load_file(base_file), load_file(merged_file), load_file(lora_file)
    assert got.keys() == base.keys()
    merged = set()
    for module in modules:
        name, key = "lora_unet_" + module.replace(".", "_"), f"{module}.weight"
        down, up, alpha = (lora[f"{name}.{s}"] for s in ("lora_down.weight", "lora_up.weight", "alpha"))
        torch.testing.assert_close(got[key], base[key] + up @ down * (alpha / down.shape[0]), rtol=1e-5, atol=1e-6)
        merged.add(key)
    assert all(torch.equal(got[k], base[k]) for k in base if k not in merged)


def web_ui_template(family_name: str, mode: str) -> dict:
    """webui/templates/<family>_<mode>.toml, checked to be the family's and the mode's and to run the family's
    script for the mode."""
    import toml

    from webui.families import script_for
    from webui.jobfiles import REPO_ROOT

    assert script_for(family_name, mode) == get_family(family_name).scripts[mode]
    template = toml.load(os.path.join(REPO_ROOT, "webui", "templates", f"{family_name}_{mode}.toml"))
    assert (template["template"]["family"], template["template"]["mode"]) == (family_name, mode)
    return template


def assert_template_passes_check_config(tmp_path, family_name: str, mode: str, template: dict, preset: str) -> None:
    """A web UI template's config on `preset`, AdamW for AdamW8bit (no bitsandbytes here) and the example data,
    the output folders set as the UI sets them (MANAGED_KEYS): the script's own --check_config passes."""
    import toml

    from library.cli.entry import run_training
    from webui.jobfiles import REPO_ROOT

    config = template["config"]
    config["model"] = {"pretrained_model_name_or_path": preset}
    config["optimizer"]["optimizer_type"] = "AdamW"
    dataset = template["dataset"]
    dataset["datasets"][0]["subsets"][0]["image_dir"] = os.path.join(REPO_ROOT, "examples/data/train/10_sks shape")
    (tmp_path / "dataset.toml").write_text(toml.dumps(dataset))
    config["output"]["output_dir"] = str(tmp_path / "out")
    config["output"]["logging_dir"] = str(tmp_path / "logs")
    config["training"]["dataset_config"] = str(tmp_path / "dataset.toml")
    (tmp_path / "config.toml").write_text(toml.dumps(config))
    assert run_training(family_name, "test", ["--config_file", str(tmp_path / "config.toml"), "--check_config"],
                        fine_tune=mode == "finetune") == 0


def apply_lora_file(family, components, path: str):
    """The networks.lora file at `path` applied to `components`' denoiser, as --network_weights applies it."""
    from networks.lora import create_network_from_weights

    network, _ = create_network_from_weights(1.0, path, components.vae, components.text_encoders,
                                             components.denoiser, lora_targets=family.lora_targets(components))
    network.apply_to(components.text_encoders, components.denoiser, apply_text_encoder=False, apply_unet=True)
    network.load_weights(path)
    return network


def assert_pipeline_lora_predicts_as_ours(family, ours, theirs, latent_channels: int) -> None:
    """`ours` (our network applied) and `theirs` (the LoRA loaded by a diffusers pipeline into its denoiser) predict
    the same for "a cat" at t = 400 (1e-6 allowed; the callers' measured figures are in their docstrings), and the
    LoRA changes the prediction (by more than 1e-2 against `theirs` with the LoRA disabled)."""
    import torch

    text = family.encode_text(ours, family.tokenize(ours, ["a cat"], None), None)
    x = torch.randn(1, latent_channels, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = family.predict(ours, x, torch.tensor([400.0]), text, {})
        b = family.predict(theirs, x, torch.tensor([400.0]), text, {})
        theirs.denoiser.disable_lora()
        base = family.predict(theirs, x, torch.tensor([400.0]), text, {})
    assert (a - base).abs().max() > 1e-2  # the LoRA changes the prediction
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def train_tiny_lora_with_sample(tmp_path, preset: str, family_name: str, network_module: str, extra: list[str],
                                probe: str) -> tuple:
    """The family's LoRA script on `preset`: 2 steps on 2 images with text-encoder outputs and latents cached, the
    denoiser only, a sample at step 2 (seed 5, which its file name records). Returns the LoRA file's path, its
    sorted keys, its metadata and its tensor `probe`."""
    import re

    from safetensors import safe_open

    data = make_dataset(str(tmp_path), n=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube --n blurry --w 64 --h 64 --s 2 --l 3.0 --d 5\n")
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), preset, steps=2, extra=[
        "--network_module", network_module, *extra, "--cache_text_encoder_outputs", "--cache_latents",
        "--network_train_unet_only", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"]), family_name)
    path = trainer.run()
    samples = os.listdir(tmp_path / "out" / "sample")
    assert any(re.match(r"lora_000002_00_\d+_5\.png$", n) for n in samples), samples
    with safe_open(path, "pt") as f:
        return path, sorted(f.keys()), f.metadata(), f.get_tensor(probe)


def assert_generation_follows_the_reference(tmp_path, model_args: list[str], network_module: str, lora_path: str,
                                            reference: str, other: str) -> None:
    """tools/generate.py on an edit model (`model_args`: --ckpt and its family flag) with the LoRA, "make it red" at
    64x64, seed 1: one image per call, the same again for the same reference, another for another reference or
    none (the reference is used)."""
    from tools import generate as tool

    def generate(outdir, *extra):
        argv = [*model_args, "--outdir", str(tmp_path / outdir), "--prompt", "make it red --w 64 --h 64 --s 2 --d 1",
                "--network_module", network_module, "--network_weights", lora_path, *extra]
        paths = tool.run(tool.options_from_args(tool.build_parser().parse_args(argv)))
        assert len(paths) == 1
        return np.asarray(Image.open(paths[0]).convert("RGB"))

    with_reference = generate("a", "--control_image", reference)
    assert with_reference.shape == (64, 64, 3)
    assert np.array_equal(with_reference, generate("b", "--control_image", reference))  # the same seed and image
    assert not np.array_equal(with_reference, generate("c", "--control_image", other))  # the reference is used
    assert not np.array_equal(with_reference, generate("d"))


def assert_written_files_load_as_the_preset(family_name: str, files: dict, preset, options_type, text_flag: str):
    """A preset written as the files users have (`files`: "diffusers", "dit", `text_flag`, "ae") loads back through
    the family as the preset `preset` (its Components): the folder, and the DiT file with --`text_flag` / --ae, give
    its DiT, AE and text encoder bitwise; the DiT under ComfyUI's model.diffusion_model. too; detect_family names the
    family for all three paths."""
    from safetensors.torch import load_file

    from library.core.safetensors_io import write_safetensors
    from library.families.base import LoadOptions
    from library.families.detect import detect_family

    family = get_family(family_name)
    folder = family.load(LoadOptions(files["diffusers"]))
    single = family.load(LoadOptions(files["dit"], family_options=options_type(
        **{text_flag: files[text_flag], "ae": files["ae"]})))
    for loaded in (folder, single):
        assert_same_weights(loaded.denoiser, preset.denoiser)
        assert_same_weights(loaded.vae, preset.vae)
        assert_same_weights(loaded.text_encoders[0], preset.text_encoders[0])
    comfy = os.path.join(os.path.dirname(files["dit"]), "comfy-whole.safetensors")
    write_safetensors({"model.diffusion_model." + k: v for k, v in load_file(files["dit"]).items()}, comfy)
    whole = family.load(LoadOptions(comfy, family_options=options_type(**{text_flag: files[text_flag]})))
    assert_same_weights(whole.denoiser, preset.denoiser)
    assert [detect_family(p) for p in (files["diffusers"], files["dit"], comfy)] == [family_name] * 3


def diffusers_loading_warnings(records) -> list:
    """The diffusers log records among `records` that are about what was loaded. Left out: diffusers' torchao
    quantizer's notice, logged once per process when torchao is first imported (peft's LoRA injection imports it on
    first use), that this torchao build's tensor classes cannot be registered: an import notice, not about a file."""
    return [r for r in records
            if r.name.startswith("diffusers") and not r.name.startswith("diffusers.quantizers.torchao")]
