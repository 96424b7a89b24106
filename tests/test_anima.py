"""Anima: the tiny preset through the real file loaders, sd-scripts' LoRA key set, training and saving.

ComfyUI's key layout for Anima LoRAs (what its loader maps, comfy/lora.py model_lora_keys_unet): for every
`diffusion_model.<path>.weight` of the DiT it accepts the kohya name `lora_unet_<path with . -> _>`, where
<path> is the original MiniTrainDIT name (`blocks.0.self_attn.q_proj`, `llm_adapter.blocks.0.self_attn.q_proj`);
Qwen3 LoRAs it reads only as `text_encoders.qwen3_06b.transformer.model.<path>.lora_A/B`, the layout sd-scripts'
convert_anima_lora_to_comfy.py (and tools/convert_lora.py --to comfy) writes. The tests below check that every
saved name is `lora_unet_` + an original key of the written DiT file (and `lora_te_` + a key of the Qwen3 file),
and that the ComfyUI layout, read by diffusers' own Anima LoRA converter into its models, gives our output.
diffusers has no Anima pipeline class whose `load_lora_weights` takes kohya files."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from library.core.errors import ConfigError
from library.families.anima import layout
from library.families import get_family
from library.families.anima.configs import build_anima_modules
from library.families.anima.loading import write_anima_preset
from library.families.common.wan_vae import to_wan, wan_to_diffusers
from library.families.anima.options import AnimaOptions
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.detect import detect_family
from networks.lora import create_network
from tests.train_helpers import assert_close_measured, base_args, largest_lora_up, make_dataset, make_trainer

TOKENS = ["--qwen3_max_token_length", "16", "--t5_max_token_length", "16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """tiny:anima as tools/make_tiny_model.py writes it: {"dit", "qwen3", "vae"}."""
    return write_anima_preset("tiny:anima", str(tmp_path_factory.mktemp("anima")))


@pytest.fixture(scope="module")
def loaded(files):
    family = get_family("anima")
    return family, family.load(LoadOptions(files["dit"], vae=files["vae"],
                                           family_options=AnimaOptions(qwen3=files["qwen3"])))


def _meta_components(name: str) -> Components:
    m = build_anima_modules(name, device="meta")
    return Components(m["dit"], m["vae"], [m["text_encoder"]], [m["tokenizer"], m["t5_tokenizer"]])


def test_files_hold_the_original_layouts_and_load_back_equal(files, loaded):
    family, c = loaded
    preset = build_anima_modules("tiny:anima")
    with safe_open(files["dit"], "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert {"net.blocks.0.self_attn.q_proj.weight", "net.blocks.1.adaln_modulation_mlp.2.weight",
            "net.x_embedder.proj.1.weight", "net.t_embedder.1.linear_2.weight", "net.t_embedding_norm.weight",
            "net.final_layer.linear.weight", "net.pos_embedder.seq", "net." + layout.ADAPTER_MARKER,
            "net.llm_adapter.blocks.1.cross_attn.k_norm.weight"} <= keys
    with safe_open(files["qwen3"], "pt") as f:
        assert "model.layers.27.self_attn.q_norm.weight" in set(f.keys())
    with safe_open(files["vae"], "pt") as f:  # ComfyUI's qwen_image_vae.safetensors names (Wan 2.1)
        assert {"conv1.weight", "encoder.downsamples.0.residual.0.gamma", "decoder.upsamples.3.time_conv.weight",
                "decoder.middle.1.to_qkv.weight", "decoder.head.2.bias"} <= set(f.keys())
    for a, b in ((preset["dit"], c.denoiser), (preset["text_encoder"], c.text_encoders[0]), (preset["vae"], c.vae)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert detect_family(files["dit"]) == "anima" and detect_family("tiny:anima") == "anima"


def test_layout_maps_are_inverse_of_diffusers_converters():
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    m = build_anima_modules("random:anima", device="meta")
    dit = m["dit"].transformer.state_dict()
    back = layout.to_diffusers({layout.transformer_original_path(k): v for k, v in dit.items()})
    assert set(back) == set(dit)
    vae = m["vae"].state_dict()
    wan = to_wan(vae)
    assert set(convert_wan_vae_to_diffusers(wan)) == set(vae)
    # the shared reader (common/wan_vae.py) names Wan 2.1's VAE as diffusers' converter did, in the same order
    assert list(wan_to_diffusers(wan)) == list(convert_wan_vae_to_diffusers(wan))


def test_adapter_comes_from_its_own_file_when_the_dit_has_none(files, tmp_path):
    from library.core.safetensors_io import write_safetensors

    with safe_open(files["dit"], "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    bare = str(tmp_path / "dit-no-adapter.safetensors")
    write_safetensors({k: v for k, v in tensors.items() if ".llm_adapter." not in k}, bare)
    adapter = str(tmp_path / "adapter.safetensors")
    write_safetensors({k[len("net."):]: v for k, v in tensors.items() if ".llm_adapter." in k}, adapter)
    family = get_family("anima")
    with pytest.raises(ModelLoadError, match="--llm_adapter_path"):
        family.load(LoadOptions(bare, family_options=AnimaOptions(qwen3=files["qwen3"])))
    c = family.load(LoadOptions(bare, family_options=AnimaOptions(qwen3=files["qwen3"], llm_adapter_path=adapter)))
    assert torch.equal(c.denoiser.llm_adapter.out_proj.weight, tensors["net.llm_adapter.out_proj.weight"])


def test_full_size_lora_key_set_equals_sd_scripts_on_meta():
    """networks/lora_anima.py on the 28-block DiT: 10 Linears a block (q/k/v/out of both attentions, 2 MLP);
    modulation, embedders and final layer excluded unless included; 6 adapter blocks x 10 with
    train_llm_adapter; Qwen3-0.6B: 28 layers x 7 (lora_te_)."""
    family = get_family("anima")
    c = _meta_components("random:anima")
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c))
    names = {lora.lora_name for lora in net.unet_loras}
    assert len(names) == 280 and len(net.text_encoder_loras) == 196
    assert {f"lora_unet_blocks_27_{n}" for n in ("self_attn_q_proj", "self_attn_output_proj", "cross_attn_v_proj",
                                                  "mlp_layer1", "mlp_layer2")} <= names
    te = {lora.lora_name for lora in net.text_encoder_loras}
    assert {"lora_te_layers_0_self_attn_q_proj", "lora_te_layers_27_mlp_gate_proj"} <= te
    with_adapter = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c),
                                  train_llm_adapter="true")
    adapter = sorted(lora.lora_name for lora in with_adapter.unet_loras if "llm_adapter" in lora.lora_name)
    assert len(adapter) == 60 and adapter[:2] == ["lora_unet_llm_adapter_blocks_0_cross_attn_k_proj",
                                                  "lora_unet_llm_adapter_blocks_0_cross_attn_o_proj"]
    everything = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c),
                                include_patterns="['.*']")
    outside = sorted(lora.lora_name for lora in everything.unet_loras if "blocks" not in lora.lora_name)
    assert len(everything.unet_loras) == 454 and outside == [
        "lora_unet_final_layer_adaln_modulation_1", "lora_unet_final_layer_adaln_modulation_2",
        "lora_unet_final_layer_linear", "lora_unet_t_embedder_1_linear_1", "lora_unet_t_embedder_1_linear_2",
        "lora_unet_x_embedder_proj_1"]
    # the LLM adapter's tensors as sd-scripts' LLMAdapter holds them (source/target/model 1024, 16 heads, 6 blocks)
    adapter_shapes = {k: tuple(v.shape) for k, v in c.denoiser.llm_adapter.state_dict().items()}
    assert len(adapter_shapes) == 4 + 6 * 19 and {
        "embed.weight": (32128, 1024), "blocks.5.self_attn.q_proj.weight": (1024, 1024),
        "blocks.5.self_attn.q_norm.weight": (64,), "blocks.5.cross_attn.k_proj.weight": (1024, 1024),
        "blocks.5.norm_mlp.weight": (1024,), "blocks.5.mlp.0.weight": (4096, 1024), "blocks.5.mlp.0.bias": (4096,),
        "blocks.5.mlp.2.weight": (1024, 4096), "out_proj.bias": (1024,), "norm.weight": (1024,),
    }.items() <= adapter_shapes.items()
    ups = {lora.lora_name: tuple(lora.lora_up.weight.shape) for lora in everything.unet_loras}
    assert ups["lora_unet_blocks_0_adaln_modulation_self_attn_2"] == (6144, 4)
    assert ups["lora_unet_blocks_0_cross_attn_k_proj"] == (2048, 4)


def test_network_args_select_dims_and_rates_by_full_original_path(loaded):
    family, c = loaded
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c),
                         exclude_patterns="['blocks\\\\.[12]\\\\..*']", network_reg_dims="blocks\\.0\\.mlp\\..*=2",
                         network_reg_lrs="blocks\\.0\\.self_attn\\..*=5e-4")
    dims = {lora.lora_name: lora.lora_dim for lora in net.unet_loras}
    assert sorted(dims) == sorted(f"lora_unet_blocks_0_{n}" for n in (
        "self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_output_proj", "cross_attn_q_proj",
        "cross_attn_k_proj", "cross_attn_v_proj", "cross_attn_output_proj", "mlp_layer1", "mlp_layer2"))
    assert dims["lora_unet_blocks_0_mlp_layer1"] == 2 and dims["lora_unet_blocks_0_cross_attn_q_proj"] == 4
    groups, _ = net.prepare_optimizer_params(None, 1e-3, 1e-3)
    rates = sorted({g["lr"] for g in groups})
    assert rates == [5e-4, 1e-3]
    with pytest.raises(ConfigError, match="network_reg_dims"):
        create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c), network_reg_dims="mlp")


def test_lora_training_run_on_the_files_with_sd_scripts_names_and_metadata(files, tmp_path):
    data = make_dataset(str(tmp_path), n=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat --w 64 --h 48 --s 2 --d 5 --l 3.0\n")
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), files["dit"], steps=2, extra=[
        "--qwen3", files["qwen3"], "--vae", files["vae"], "--network_module", "networks.lora_anima",
        "--network_args", "train_llm_adapter=True", "--timestep_sampling", "shift", "--discrete_flow_shift", "3.0",
        "--sample_prompts", str(prompts), "--sample_every_n_steps", "2", *TOKENS]), "anima")
    path = trainer.run()
    samples = sorted(os.listdir(tmp_path / "out" / "sample"))
    assert samples[0].startswith("lora_000002_00_") and samples[0].endswith("_5.png")  # step 2, seed 5
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        metadata = f.metadata()
        up = f.get_tensor("lora_unet_llm_adapter_blocks_1_mlp_2.lora_up.weight")
    modules = {k.split(".")[0] for k in keys}
    with safe_open(files["dit"], "pt") as f:
        dit_paths = {k[len("net."):-len(".weight")].replace(".", "_") for k in f.keys() if k.endswith(".weight")}
    with safe_open(files["qwen3"], "pt") as f:
        te_paths = {k[len("model."):-len(".weight")].replace(".", "_") for k in f.keys()}
    # the ComfyUI layout: lora_unet_<original DiT key>, lora_te_<Qwen3 key> (see the module docstring)
    assert all(m[len("lora_unet_"):] in dit_paths or m[len("lora_te_"):] in te_paths for m in modules)
    assert len(modules) == 3 * 10 + 2 * 10 + 28 * 7 and len(keys) == 3 * len(modules)
    assert up.abs().sum() > 0  # the adapter's LoRA trained
    assert (metadata["ss_base_model_version"], metadata["ss_network_module"], metadata["modelspec.architecture"],
            metadata["modelspec.implementation"], metadata["ss_timestep_sampling"],
            metadata["ss_discrete_flow_shift"]) == ("anima", "networks.lora_anima", "anima-preview/lora",
                                                    "https://huggingface.co/circlestone-labs/Anima", "shift", "3.0")


def test_full_fine_tune_saves_a_dit_file_that_loads_back_with_the_adapter_frozen(files, tmp_path):
    data = make_dataset(str(tmp_path), n=1)
    argv = base_args(data, str(tmp_path / "out"), "tiny:anima", steps=1, extra=[
        "--save_model_as", "safetensors", "--llm_adapter_lr", "0", "--mod_lr", "0", *TOKENS])
    network_flags = {"--network_module", "--network_dim", "--network_alpha"}
    argv = [a for i, a in enumerate(argv) if a not in network_flags and (i == 0 or argv[i - 1] not in network_flags)]
    from library.cli.config_file import parse_with_config_file
    from library.cli.entry import build_parser, settings_from_args
    from library.train.trainer import Trainer

    family = get_family("anima")
    ns = parse_with_config_file(build_parser("test", family, fine_tune=True), argv)
    trainer = Trainer(family, settings_from_args(ns, family, fine_tune=True))
    path = trainer.run()
    before = build_anima_modules("tiny:anima")["dit"].state_dict()
    back = family.load(LoadOptions(path, vae=files["vae"], family_options=AnimaOptions(qwen3=files["qwen3"])))
    after = back.denoiser.state_dict()
    assert after.keys() == before.keys()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert "transformer.transformer_blocks.0.attn1.to_q.weight" in changed
    assert not any(k.startswith("llm_adapter.") or ".norm1.linear" in k for k in changed)  # frozen at lr 0


def test_missing_component_files_are_one_line_errors(files):
    family = get_family("anima")
    with pytest.raises(ModelLoadError, match="--qwen3: required"):
        family.check_options(AnimaOptions(), LoadOptions(files["dit"], vae=files["vae"]))
    with pytest.raises(ModelLoadError, match="--vae: required"):
        family.check_options(AnimaOptions(qwen3=files["qwen3"]), LoadOptions(files["dit"]))
    with pytest.raises(ModelLoadError, match="expected a Qwen3 text encoder"):
        family.load(LoadOptions(files["dit"], family_options=AnimaOptions(qwen3=files["vae"])))
    with pytest.raises(ConfigError, match="--t5_max_token_length"):
        AnimaOptions(t5_max_token_length=600).check()


def test_weighting_scheme_weights_the_raw_velocity_loss_as_sd_scripts(loaded):
    """compute_loss_weighting_for_anima: sigma_sqrt σ^-2 and cosmap 2/(π(1-2σ+2σ²)) on the raw prediction."""
    import math

    from library.families.anima.options import AnimaFlowOptions

    family, c = loaded
    t = torch.tensor([250.0, 500.0])
    for scheme, expected in (("sigma_sqrt", [16.0, 4.0]),
                             ("cosmap", [2 / (math.pi * (1 - 0.5 + 0.125)), 2 / (math.pi * 0.5)]),
                             ("uniform", [1.0, 1.0])):
        options = AnimaOptions(flow=AnimaFlowOptions(weighting_scheme=scheme))
        weights = family.noise_scheme(Components(c.denoiser, None, [], [], options=options)).loss_weights(t)
        torch.testing.assert_close(weights, torch.tensor(expected))


def test_generation_is_seeded_and_sized(loaded):
    from library.sampling.generate import GenerationRequest

    family, c = loaded
    images = family.generate(c, [GenerationRequest("a cat", seed=3, width=64, height=80, steps=2),
                                 GenerationRequest("a dog", seed=3, width=64, height=80, steps=2)])
    again = family.generate(c, [GenerationRequest("a cat", seed=3, width=64, height=80, steps=2)])
    import numpy as np

    first, single, other = (np.asarray(i.image, dtype=np.int16) for i in (images[0], again[0], images[1]))
    assert images[0].image.size == (64, 80)
    assert np.abs(first - single).max() <= 1  # the same seed alone or in a batch (batched matmul rounding)
    assert np.abs(first - other).max() > 0  # the prompt reaches the image through Qwen3 and the adapter
    assert os.path.basename(c.model_path).startswith("anima-tiny")


def _documented_command() -> list[str]:
    """The tokens of the command line after the marker in docs/anima_train_network.md."""
    import re
    import shlex

    lines = open(os.path.join(os.path.dirname(__file__), "..", "docs", "anima_train_network.md"),
                 encoding="utf-8").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- sd-scripts command line:")) + 2
    end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
    return shlex.split(re.sub(r"\\\n", " ", "\n".join(lines[start:end])))


def test_sd_scripts_command_line_of_the_docs_runs_on_the_tiny_files(files, tmp_path):
    """Only the model paths, the dataset, the output folder, epochs -> 1 step, and what a CPU lacks change."""
    import importlib.util

    from library.cli.entry import run_training

    tokens = _documented_command()
    script = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
    assert tokens[script] == "anima_train_network.py"
    data = make_dataset(str(tmp_path), n=1)
    toml = tmp_path / "data.toml"
    toml.write_text(f'[general]\ncaption_extension = ".txt"\nresolution = 64\n[[datasets]]\n'
                    f'[[datasets.subsets]]\nimage_dir = "{os.path.join(data, "5_sks toy")}"\n')
    swap = {"--pretrained_model_name_or_path": files["dit"], "--qwen3": files["qwen3"], "--vae": files["vae"],
            "--dataset_config": str(toml), "--output_dir": str(tmp_path / "out")}
    argv = []
    for token in tokens[script + 1:]:
        flag, eq, value = token.partition("=")
        if flag == "--max_train_epochs":
            continue
        if flag in swap:
            value = swap[flag]
        elif flag == "--optimizer_type" and importlib.util.find_spec("bitsandbytes") is None:
            value = "AdamW"
        elif flag == "--mixed_precision" and not torch.cuda.is_available():
            value = "no"
        argv.append(f"{flag}={value}" if eq else flag)
    argv += ["--max_train_steps", "1", "--max_data_loader_n_workers", "0", *TOKENS]
    assert run_training("anima", "test", argv) == 0
    with safe_open(str(tmp_path / "out" / "my_anima_lora.safetensors"), "pt") as f:
        assert f.metadata()["ss_network_module"] == "networks.lora_anima"
        assert "lora_unet_blocks_1_mlp_layer2.lora_up.weight" in set(f.keys())


def test_resumed_anima_run_equals_uninterrupted(tmp_path):
    """Stopped after step 2 (the SIGTERM path) and resumed with --resume auto: bitwise the same LoRA, the
    adapter's LoRA and the sigmoid σ draws included."""
    import signal

    from safetensors.torch import load_file

    from library.train.trainer import InterruptedTraining

    data = make_dataset(str(tmp_path), n=2)
    extra = ["--network_module", "networks.lora_anima", "--network_args", "train_llm_adapter=True",
             "--network_train_unet_only", *TOKENS]
    straight = make_trainer(base_args(data, str(tmp_path / "a"), "tiny:anima", steps=4, extra=extra), "anima").run()
    first = make_trainer(base_args(data, str(tmp_path / "b"), "tiny:anima", steps=4, extra=extra), "anima")

    def stop(trainer, event, step):
        if event == "step" and step == 2:
            trainer._on_signal(signal.SIGTERM, None)

    first.s.hooks.append(stop)
    with pytest.raises(InterruptedTraining):
        first.run()
    resumed = make_trainer(base_args(data, str(tmp_path / "b"), "tiny:anima", steps=4,
                                     extra=[*extra, "--resume", "auto"]), "anima").run()
    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_comfy_layout_loads_in_diffusers_anima_lora_loader_with_the_same_output(loaded):
    """kohya -> ComfyUI names (tools/convert_lora.py --to comfy), read by diffusers' own Anima LoRA converter
    (AnimaLoraLoaderMixin.lora_state_dict) into CosmosTransformer3DModel and AnimaTextConditioner through PEFT:
    every key is used and the denoiser's output equals the one with our LoRA modules applied."""
    import copy
    import re

    from diffusers.loaders.lora_pipeline import AnimaLoraLoaderMixin

    from library.families.anima import lora_comfy as anima_lora

    family, c = loaded
    dit = copy.deepcopy(c.denoiser)
    components = Components(dit, None, [], c.tokenizers, options=c.options)
    net = create_network(1.0, 4, 4, None, None, None, lora_targets=family.lora_targets(components),
                         train_llm_adapter="true")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in net.unet_loras:
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=gen) * 0.1)
    comfy = anima_lora.to_comfy(net.state_dict())
    assert len(comfy) == 3 * 50 and "diffusion_model.llm_adapter.blocks.0.mlp.2.lora_B.weight" in comfy
    # alpha = rank here, so the scale is 1 and diffusers (which takes no alpha keys) needs none
    converted = AnimaLoraLoaderMixin.lora_state_dict({k: v for k, v in comfy.items() if not k.endswith(".alpha")})
    assert len(converted) == 100 and all(k.startswith(("transformer.", "text_conditioner.")) for k in converted)
    peft_dit = copy.deepcopy(c.denoiser)
    peft_dit.transformer.load_lora_adapter({k: v for k, v in converted.items() if k.startswith("transformer.")},
                                           prefix="transformer")
    peft_dit.llm_adapter.load_lora_adapter({k: v for k, v in converted.items() if k.startswith("text_conditioner.")},
                                           prefix="text_conditioner")
    n_peft = sum(1 for name, _ in peft_dit.named_modules() if re.search(r"\.lora_A\.default(_0)?$", name))
    assert n_peft == 50  # every module of the file found its layer
    net.apply_to([], dit, False, True)
    gen = torch.Generator().manual_seed(1)
    latents, t = torch.randn(1, 16, 8, 8, generator=gen), torch.tensor([0.7])
    states, mask = torch.randn(1, 6, 32, generator=gen), torch.ones(1, 6, dtype=torch.long)
    ids, t5_mask = torch.tensor([[5, 9, 12, 1]]), torch.ones(1, 4, dtype=torch.long)
    with torch.no_grad():
        ours = dit(latents, t, states, mask, ids, t5_mask)
        theirs = peft_dit(latents, t, states, mask, ids, t5_mask)
        base = c.denoiser(latents, t, states, mask, ids, t5_mask)
    assert (ours - base).abs().max() > 1e-3  # the LoRA changes the output
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_blocks_to_swap_trains_as_without_and_is_bounded_as_sd_scripts(tmp_path, files):
    """--blocks_to_swap 1 (the last DiT block streamed) gives the LoRA of no swapping, up to float rounding (the
    block runs on copies of its weights); more than blocks - 2 is refused before loading, naming the bound."""
    from safetensors.torch import load_file

    data = make_dataset(str(tmp_path), n=1)
    extra = ["--network_module", "networks.lora_anima", "--network_train_unet_only", *TOKENS]
    runs = [make_trainer(base_args(data, str(tmp_path / name), "tiny:anima", steps=2, extra=extra + more),
                         "anima").run() for name, more in (("plain", []), ("swap", ["--blocks_to_swap", "1"]))]
    a, b = (load_file(p) for p in runs)
    # the same ops on copies of the weights: measured 0 with the AVX-512, AVX2 and default kernels
    # (ATEN_CPU_CAPABILITY); 3e-5 leaves room for kernels that depend on alignment. The swapped block's weights
    # copied through float16 give 7.7e-5, zeros in their place 4e-3
    assert_close_measured(b, a, 3e-5, "anima swap vs plain: LoRA")
    assert largest_lora_up(a) > 1e-3  # trained: 10 times the tolerance
    family = get_family("anima")
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 2: expected 1\.\.1 for this model \(3 blocks"):
        family.check_options(AnimaOptions(qwen3=files["qwen3"]), LoadOptions(files["dit"], vae=files["vae"]),
                             blocks_to_swap=2)


def test_merge_and_extract_tools_work_on_the_dit_file(files, tmp_path):
    """tools/merge_lora.py writes W + scale·up@down into a DiT file that loads back; extract_lora_from_models.py
    recovers a rank-4 LoRA of that difference under the same names (the adapter's LoRA included)."""
    from safetensors.torch import load_file

    from tools import extract_lora_from_models, merge_lora

    family = get_family("anima")
    base = family.load(LoadOptions(files["dit"], family_options=AnimaOptions(qwen3=files["qwen3"])))
    net = create_network(1.0, 4, 2, None, None, None, lora_targets=family.lora_targets(base), train_llm_adapter="1")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in net.unet_loras:
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=gen) * 0.2)
    lora_file = str(tmp_path / "lora.safetensors")
    net.save_weights(lora_file, None, {})
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", files["dit"], "--qwen3", files["qwen3"], "--models", lora_file,
                            "--ratios", "1.0", "--save_to", merged]) == 0
    back = family.load(LoadOptions(merged, family_options=AnimaOptions(qwen3=files["qwen3"])))
    lora = next(m for m in net.unet_loras if m.lora_name == "lora_unet_llm_adapter_blocks_1_cross_attn_k_proj")
    expected = base.denoiser.llm_adapter.blocks[1].cross_attn.k_proj.weight \
        + 0.5 * lora.lora_up.weight @ lora.lora_down.weight  # alpha 2 / rank 4
    torch.testing.assert_close(back.denoiser.llm_adapter.blocks[1].cross_attn.k_proj.weight, expected)
    extracted = str(tmp_path / "extracted.safetensors")
    assert extract_lora_from_models.main(["--model_org", files["dit"], "--model_tuned", merged, "--qwen3",
                                          files["qwen3"], "--dim", "4", "--clamp_quantile", "1.0",
                                          "--save_to", extracted]) == 0
    state = load_file(extracted)
    name = "lora_unet_blocks_2_self_attn_q_proj"
    delta = state[f"{name}.lora_up.weight"] @ state[f"{name}.lora_down.weight"] * float(state[f"{name}.alpha"]) / 4
    orig = next(m for m in net.unet_loras if m.lora_name == name)
    torch.testing.assert_close(delta, 0.5 * orig.lora_up.weight @ orig.lora_down.weight, rtol=1e-3, atol=1e-4)


def test_anima_train_refuses_a_save_format_it_cannot_write_before_training(capsys):
    from library.cli.entry import run_training

    with pytest.raises(SystemExit) as stopped:
        run_training("anima", "test", ["--pretrained_model_name_or_path", "tiny:anima", "--save_model_as",
                                       "diffusers", "--output_dir", "out"], fine_tune=True)
    assert stopped.value.code == 2
    assert "--save_model_as: invalid choice: 'diffusers' (choose from 'safetensors')" in capsys.readouterr().err


def test_lycoris_presets_reach_anima_through_the_class_aliases(tmp_path):
    """LyCORIS presets name sd-scripts' Anima classes (Block, LLMAdapterTransformerBlock, ...); through the family's
    aliases a LoKr run wraps the diffusers blocks and saves under the original names."""
    pytest.importorskip("lycoris")
    from safetensors import safe_open

    data = make_dataset(str(tmp_path), n=1)
    argv = base_args(data, str(tmp_path / "out"), "tiny:anima", steps=1, extra=[
        "--network_train_unet_only", "--network_args", "algo=lokr", "preset=attn-mlp", *TOKENS])
    argv[argv.index("networks.lora")] = "lycoris.kohya"
    path = make_trainer(argv, "anima").run()
    with safe_open(path, "pt") as f:
        modules = {k.split(".")[0] for k in f.keys()}
    assert {"lora_unet_blocks_2_self_attn_q_proj", "lora_unet_blocks_0_mlp_layer2",
            "lora_unet_llm_adapter_blocks_1_cross_attn_o_proj"} <= modules
    assert all(m.startswith("lora_unet_") for m in modules)
