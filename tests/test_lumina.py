"""Lumina Image 2.0: the original NextDiT layout against diffusers' own converter, the tiny preset written as the
files users have and loaded back by the real loaders, sd-scripts' kohya LoRA names (fused GQA qkv) on the full-size
model, text as sd-scripts tokenizes it, a short LoRA training run and generation."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.lumina import layout
from library.families.common.dit_layout import COMFY_PREFIX
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.lumina.configs import (
    PRESETS,
    build_lumina_modules,
    transformer_config,
)
from library.families.lumina.loading import write_lumina_preset
from library.families.lumina.options import LuminaOptions
from networks.lora import create_network
from tests.train_helpers import (assert_close_measured, assert_only_denoiser_moved, base_args, fine_tune_one_step,
                                 largest_lora_up, make_dataset, make_trainer, random_lora_file)


@pytest.fixture(scope="module")
def lumina_files(tmp_path_factory):
    return write_lumina_preset("tiny:lumina", str(tmp_path_factory.mktemp("lumina-files")))


@pytest.fixture(scope="module")
def tiny_lumina():
    return get_family("lumina").load(LoadOptions("tiny:lumina"))


def test_original_layout_matches_diffusers_converter_at_full_size():
    """Our NextDiT names of the 2B model, converted by diffusers' own Lumina2 single-file converter, give exactly the
    model's keys and shapes (its q/k/v split is hard-wired to the 2B widths 2304 / 768 / 768)."""
    from diffusers import Lumina2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    with torch.device("meta"):
        model = Lumina2Transformer2DModel(**transformer_config(PRESETS["random:lumina2"]))
    state = model.state_dict()
    original = layout.to_original(state)
    # 26 joint + 2 noise refiner blocks x 13 tensors, 2 context refiner x 11, 14 outside (norm_final included)
    assert len(original) == 28 * 13 + 2 * 11 + 14
    assert original["layers.0.attention.qkv.weight"].shape == (2304 + 2 * 768, 2304)
    converted = convert_lumina2_to_diffusers(dict(original))
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in state.items()}


def test_tiny_files_load_through_the_real_loaders(lumina_files, tiny_lumina):
    from library.families.detect import detect_family

    with safe_open(lumina_files["dit"], "pt") as f:
        keys = set(f.keys())
    assert "layers.0.attention.qkv.weight" in keys and "final_layer.adaLN_modulation.1.weight" in keys
    assert not any("to_q" in k or k.startswith("model.") for k in keys)
    with safe_open(lumina_files["gemma2"], "pt") as f:
        assert all(k.startswith("model.") for k in f.keys())
    loaded = get_family("lumina").load(LoadOptions(lumina_files["dit"], family_options=LuminaOptions(
        gemma2=lumina_files["gemma2"], ae=lumina_files["ae"])))
    for a, b in ((loaded.denoiser, tiny_lumina.denoiser), (loaded.vae, tiny_lumina.vae),
                 (loaded.text_encoders[0], tiny_lumina.text_encoders[0])):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), type(a).__name__
    assert loaded.tokenizers[0].get_vocab() == tiny_lumina.tokenizers[0].get_vocab()
    assert detect_family(lumina_files["dit"]) == "lumina" and detect_family("tiny:lumina") == "lumina"
    # ComfyUI's whole-model prefix loads the same DiT
    from library.families.lumina.loading import load_dit_file

    comfy = lumina_files["dit"].replace(".safetensors", "-comfy.safetensors")
    from safetensors.torch import save_file
    save_file({COMFY_PREFIX + k: v for k, v in load_file(lumina_files["dit"]).items()}, comfy)
    again = load_dit_file(comfy, torch.float32).state_dict()
    assert all(torch.equal(again[k], v) for k, v in tiny_lumina.denoiser.state_dict().items())


def test_option_errors_are_one_line(lumina_files):
    family = get_family("lumina")
    with pytest.raises(ModelLoadError, match=r"^--gemma2: required with a Lumina DiT file"):
        family.load(LoadOptions(lumina_files["dit"]))
    with pytest.raises(ModelLoadError, match=r"^--gemma2 .*: expected a Gemma-2 text encoder \(model.layers.\* keys\), found a Lumina Image 2.0 DiT$"):
        family.load(LoadOptions(lumina_files["dit"], family_options=LuminaOptions(gemma2=lumina_files["dit"])))
    with pytest.raises(ConfigError, match=r"^--gemma2_max_token_length: expected an integer from 1 to 8192, got 0$"):
        LuminaOptions(gemma2_max_token_length=0).check()
    with pytest.raises(ConfigError, match=r"^--v_parameterization: only for DDPM"):
        family.check_options(LuminaOptions(), LoadOptions("tiny:lumina", v_parameterization=True))


def test_full_size_lora_names_on_meta():
    """sd-scripts' networks.lora_lumina on the 2B model: every Linear in the joint / refiner blocks and the final
    layer under its NextDiT name, Gemma-2's attention and MLP under lora_te_."""
    family = get_family("lumina")
    parts = build_lumina_modules("random:lumina2", device="meta")
    c = Components(parts["transformer"], parts["vae"], [parts["text_encoder"]], [parts["tokenizer"]])
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c))
    names = [lora.lora_name for lora in net.unet_loras]
    assert len(names) == 26 * 6 + 2 * 6 + 2 * 5 + 2 == 180
    # Independently, from the original file's keys: each 2-D weight of a block or the final layer.
    original = layout.to_original(c.denoiser.state_dict())
    expected = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in original.items()
                if re.match(r"(layers|noise_refiner|context_refiner|final_layer)\.", k) and k.endswith(".weight")
                and v.dim() == 2}
    assert set(names) == expected
    ups = {lora.lora_name: lora.lora_up.weight.shape[0] for lora in net.unet_loras}
    assert ups["lora_unet_layers_0_attention_qkv"] == 2304 + 2 * 768
    assert ups["lora_unet_noise_refiner_1_adaLN_modulation_1"] == 4 * 2304
    assert "lora_unet_context_refiner_0_adaLN_modulation_1" not in ups
    assert ups["lora_unet_final_layer_linear"] == 2 * 2 * 16
    te = [lora.lora_name for lora in net.text_encoder_loras]
    assert len(te) == 26 * 7 and "lora_te_layers_25_self_attn_o_proj" in te and "lora_te_layers_0_mlp_gate_proj" in te
    assert family.modelspec_architecture(c, 1024) == "lumina-2" and family.base_model_version(c) == "lumina2"
    assert family.block_classes == ("Lumina2TransformerBlock",)


def independent_merge(original: dict, lora: dict) -> tuple[dict, int]:
    """NextDiT-layout tensors with each lora_unet module's up @ down · alpha / rank added to the weight whose
    original name, dots as underscores, is the module's name; and how many modules were merged."""
    merged = {k: v.clone() for k, v in original.items()}
    by_name = {"lora_unet_" + k[:-len(".weight")].replace(".", "_"): k for k in merged if k.endswith(".weight")}
    used = 0
    for key in lora:
        if key.startswith("lora_unet_") and key.endswith(".lora_down.weight"):
            name = key[:-len(".lora_down.weight")]
            down, up, alpha = lora[key], lora[f"{name}.lora_up.weight"], lora[f"{name}.alpha"]
            merged[by_name[name]] += up @ down * (alpha / down.shape[0])
            used += 1
    return merged, used


def test_lora_equals_an_independent_merge_in_the_original_layout(tmp_path):
    """The LoRA-patched DiT equals one whose NextDiT-layout weights (q, k, v fused) had up @ down · alpha / rank
    added per module, loaded back by the single-file loader."""
    from library.families.lumina.loading import load_dit_file

    family = get_family("lumina")
    c = family.load(LoadOptions("tiny:lumina"))
    path = random_lora_file(family, c, str(tmp_path / "lora.safetensors"))
    merged, used = independent_merge(layout.to_original(c.denoiser.state_dict()), load_file(path))
    assert used == 42
    file = str(tmp_path / "merged.safetensors")
    from safetensors.torch import save_file
    save_file(merged, file)
    reference = load_dit_file(file, torch.float32)
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
    net.load_weights(path)
    net.apply_to(c.text_encoders, c.denoiser, False, True)
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(2, 8, 32, generator=gen)
    mask, t = torch.ones(2, 8, dtype=torch.bool), torch.tensor([0.25, 0.75])
    mask[1, 5:] = False
    with torch.no_grad():
        ours = c.denoiser(x, t, ctx, mask, return_dict=False)[0]
        theirs = reference(x, t, ctx, mask, return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_text_as_sd_scripts_tokenizes_and_encodes(tiny_lumina):
    family, c = get_family("lumina"), tiny_lumina
    tok = c.tokenizers[0]
    c.options.system_prompt = "You are an assistant."
    try:
        ids, mask = family.tokenize(c, ["a photo of a cat"], None)
    finally:
        c.options.system_prompt = ""
    ref = tok("You are an assistant. <Prompt Start> a photo of a cat", padding="max_length", max_length=256,
              truncation=True, return_tensors="pt")
    assert ids.shape == (1, 256) and torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
    assert ids[0, 0] == 2 and ids[0, -1] == 0  # <bos> first, <pad> (0) on the right
    plain, _ = family.tokenize(c, ["a photo of a cat"], None)
    assert torch.equal(plain, tok("a photo of a cat", padding="max_length", max_length=256,
                                  return_tensors="pt").input_ids)
    encoder = c.text_encoders[0]
    with torch.no_grad():
        text = family.encode_text(c, [ids[:, :16], mask[:, :16]], None)
        hidden = encoder(input_ids=ids[:, :16], attention_mask=mask[:, :16], output_hidden_states=True).hidden_states
    assert set(text.tensors) == {"hidden_state", "input_ids", "attention_mask"}
    assert torch.equal(text.tensors["hidden_state"], hidden[-2]) and not torch.equal(hidden[-2], hidden[-1])


def test_predict_is_the_velocity_at_one_minus_sigma(tiny_lumina):
    """predict = -(DiT at t = 1 - σ): at σ near 0 on clean latents x0 with ε, the flow target ε - x0 relation holds
    for the scheme (velocity), so the DiT's own output is x0 - ε (sd-scripts' target latents - noise)."""
    family, c = get_family("lumina"), tiny_lumina
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 16, 8, 8, generator=gen)
    text = {"hidden_state": torch.randn(1, 8, 32, generator=gen), "attention_mask": torch.ones(1, 8, dtype=torch.long),
            "input_ids": torch.zeros(1, 8, dtype=torch.long)}
    from library.families.base import TextConditioning

    with torch.no_grad():
        ours = family.predict(c, x, torch.tensor([300.0]), TextConditioning(text), {})
        direct = c.denoiser(x, torch.tensor([0.7]), text["hidden_state"], text["attention_mask"].bool(),
                            return_dict=False)[0]
    torch.testing.assert_close(ours, -direct)


def test_tiny_lumina_lora_training_run(tmp_path):
    import os

    data = make_dataset(str(tmp_path), n=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube --n blurry --w 64 --h 64 --s 2 --l 3.0 --d 5\n")
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:lumina", steps=2, extra=[
        "--network_module", "networks.lora_lumina", "--gemma2_max_token_length", "16", "--cache_text_encoder_outputs",
        "--network_train_unet_only", "--system_prompt", "You are an assistant designed to generate images.",
        "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"]), "lumina")
    path = trainer.run()
    samples = os.listdir(tmp_path / "out" / "sample")
    assert any(re.match(r"lora_000002_00_\d+_5\.png$", n) for n in samples), samples  # sampled with the TE cache
    with safe_open(path, "pt") as f:
        keys = sorted(f.keys())
        metadata = f.metadata()
        up = f.get_tensor("lora_unet_layers_0_attention_qkv.lora_up.weight")
    assert len(keys) == 42 * 3 and all(k.startswith("lora_unet_") for k in keys)
    assert up.shape == (48 + 2 * 24, 4) and up.abs().sum() > 0  # trained
    assert (metadata["ss_base_model_version"], metadata["modelspec.architecture"], metadata["ss_network_module"]) \
        == ("lumina2", "lumina-2/lora", "networks.lora_lumina")
    assert (metadata["ss_timestep_sampling"], metadata["ss_discrete_flow_shift"],
            metadata["ss_model_prediction_type"]) == ("shift", "6.0", "raw")


def test_sampler_sigmas_are_shifted_by_six():
    """Lumina's sampler σ: 1 to 0, each shifted by 6 (sd-scripts' default); images: tests/test_family_contract.py."""
    from library.families.lumina.generate import lumina_sigmas
    from library.objectives.flow import shift_sigmas

    sigmas = lumina_sigmas(4, 6.0)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    torch.testing.assert_close(sigmas[2], shift_sigmas(torch.tensor(0.5, dtype=torch.float64), 6.0).float())


def test_nextdit_shift_is_uniform_then_shifted_by_image_size():
    """sd-scripts' nextdit_shift: σ = e^μ / (e^μ + 1/u - 1), u uniform, μ linear in the 2x2-patch count
    (0.5 at 256, 1.15 at 4096)."""
    import math

    from library.families.lumina.family import LuminaFlowScheme
    from library.families.lumina.options import LuminaFlowOptions

    scheme = LuminaFlowScheme(LuminaFlowOptions(timestep_sampling="nextdit_shift"))
    sigmas = scheme.sample_sigmas(4, torch.Generator().manual_seed(3), (1, 16, 64, 64))
    u = torch.rand(4, generator=torch.Generator().manual_seed(3)).clamp(min=1e-7)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (32 * 32 - 256)
    torch.testing.assert_close(sigmas, math.exp(mu) / (math.exp(mu) + (1 / u - 1)))
    with pytest.raises(ConfigError, match=r"^--timestep_sampling: expected one of .*nextdit_shift, got 'x'$"):
        LuminaFlowOptions(timestep_sampling="x").check()


def test_documented_sd_scripts_command_line_runs(example_data, tmp_path, monkeypatch, capsys):  # noqa: F811
    """docs/lumina_train_network.md's sd-scripts command line trains one step on tiny:lumina with only the
    substitutions of tests/test_sd_scripts_command_lines.py (model and component paths, data, output)."""
    import os

    from library.cli.entry import run_training
    from tests import test_sd_scripts_command_lines as doc_lines

    monkeypatch.setattr(doc_lines, "DOCS", ("docs/lumina_train_network.md",))
    monkeypatch.setitem(doc_lines.SCRIPTS, "lumina_train_network.py", ("lumina", "tiny:lumina"))
    monkeypatch.setattr(doc_lines, "MODEL_PARTS", doc_lines.MODEL_PARTS | {"--gemma2"})
    (where, command), = doc_lines.documented_command_lines()
    family, script, argv = doc_lines.adapt(command, *example_data, str(tmp_path / "out"))
    assert (family, script) == ("lumina", "lumina_train_network.py")
    assert "nextdit_shift" in argv and "--system_prompt" in argv
    code = run_training(family, script, argv)
    err = capsys.readouterr().err
    assert code == 0, f"{where}: {err.strip().splitlines()[-1:]}"
    saved = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    assert saved == ["my_lumina_lora.safetensors"]


def test_full_fine_tune_saves_an_original_dit_file_that_loads_back(tmp_path, lumina_files, tiny_lumina):
    """lumina_train.py: one step; the saved DiT is in the original NextDiT names, loads back through the
    single-file loader, and only the DiT moved (Gemma-2 is not trained without --train_text_encoder)."""
    path, _ = fine_tune_one_step(tmp_path, "lumina", "tiny:lumina", ["--gemma2_max_token_length", "8"], "lumina-2",
                                 lumina_files["dit"])
    loaded = get_family("lumina").load(LoadOptions(path, family_options=LuminaOptions(
        gemma2=lumina_files["gemma2"], ae=lumina_files["ae"])))
    assert_only_denoiser_moved(loaded, tiny_lumina)


def test_merge_tool_writes_the_merged_original_dit(tmp_path, lumina_files, tiny_lumina):
    """tools/merge_lora.py on the Lumina files (--gemma2 / --ae as training takes them): the saved DiT equals the
    independent merge in the NextDiT layout."""
    from tools import merge_lora

    family = get_family("lumina")
    lora_path = random_lora_file(family, tiny_lumina, str(tmp_path / "lora.safetensors"))
    out = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", lumina_files["dit"], "--gemma2", lumina_files["gemma2"], "--ae",
                            lumina_files["ae"], "--models", lora_path, "--ratios", "1.0", "--save_to", out]) == 0
    expected, used = independent_merge(load_file(lumina_files["dit"]), load_file(lora_path))
    got = load_file(out)
    assert used == 42 and got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)


def test_blocks_to_swap_trains_as_without_and_is_bounded_as_sd_scripts(tmp_path, lumina_files):
    """--blocks_to_swap 1 (the last joint block streamed) gives the LoRA of no swapping, up to float rounding (the
    block runs on copies of its weights); more than blocks - 2 is refused before loading, naming the bound."""
    data = make_dataset(str(tmp_path), n=1)
    extra = ["--network_module", "networks.lora_lumina", "--network_train_unet_only", "--gemma2_max_token_length", "8"]
    runs = [make_trainer(base_args(data, str(tmp_path / name), "tiny:lumina", steps=2, extra=extra + more),
                         "lumina").run() for name, more in (("plain", []), ("swap", ["--blocks_to_swap", "1"]))]
    a, b = (load_file(p) for p in runs)
    # the same ops on copies of the weights: measured 0 with the AVX-512, AVX2 and default kernels
    # (ATEN_CPU_CAPABILITY); 3e-5 leaves room for kernels that depend on alignment. The swapped block's weights
    # copied through float16 give 1.7e-3, zeros in their place 4e-3
    assert_close_measured(b, a, 3e-5, "lumina swap vs plain: LoRA")
    assert largest_lora_up(a) > 1e-3  # trained: 10 times the tolerance
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 2: expected 1\.\.1 for this model \(3 blocks"):
        get_family("lumina").check_options(LuminaOptions(gemma2=lumina_files["gemma2"], ae=lumina_files["ae"]),
                                           LoadOptions(lumina_files["dit"]), blocks_to_swap=2)


def test_sd_scripts_network_args_on_the_full_size_model():
    """sd-scripts' lora_lumina arguments: train_blocks filters the DiT modules by name, the type dims take the first
    matching word (attention, mlp, modulation, refiner), Gemma-2's modules keep the network dim (embedder_dims and
    split_qkv: tests/test_lumina_network_args.py)."""
    family = get_family("lumina")
    parts = build_lumina_modules("random:lumina2", device="meta")
    c = Components(parts["transformer"], parts["vae"], [parts["text_encoder"]], [parts["tokenizer"]])

    def dims(**args) -> dict[str, int]:
        net = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c), **args)
        return {m.lora_name: m.lora_dim for m in net.unet_loras + net.text_encoder_loras}

    only = dims(train_blocks="transformer")
    assert sum(n.startswith("lora_unet_") for n in only) == 26 * 6 and sum(n.startswith("lora_te_") for n in only) == 182
    refiners = dims(train_blocks="refiners")
    assert {n for n in refiners if n.startswith("lora_unet_")} == {
        n for n in dims() if n.startswith(("lora_unet_noise_refiner_", "lora_unet_context_refiner_"))}
    typed = dims(attn_dim="8", mod_dim="2", refiner_dim="6", mlp_dim="16")
    assert typed["lora_unet_layers_3_attention_qkv"] == 8 and typed["lora_unet_noise_refiner_0_attention_out"] == 8
    assert typed["lora_unet_layers_3_adaLN_modulation_1"] == 2 and typed["lora_unet_final_layer_adaLN_modulation_1"] == 2
    assert typed["lora_unet_noise_refiner_1_feed_forward_w2"] == 6 and typed["lora_unet_layers_0_feed_forward_w1"] == 4
    assert typed["lora_te_layers_0_self_attn_q_proj"] == 4
    assert "lora_unet_layers_0_attention_qkv" not in dims(attn_dim="0")
    with pytest.raises(ConfigError, match=r"^--network_args train_blocks: expected one of all, transformer, "):
        dims(train_blocks="single")


def test_extract_recovers_the_merged_difference(tmp_path, lumina_files, tiny_lumina):
    """extract_lora_from_models.py between the tiny DiT file and a merged one (rank-4 LoRA per module) writes the
    46 DiT modules under their sd-scripts names; each up @ down · alpha / rank equals the merged difference (no
    clamping: --clamp_quantile 1.0)."""
    from tools import extract_lora_from_models, merge_lora

    family = get_family("lumina")
    lora_path = random_lora_file(family, tiny_lumina, str(tmp_path / "lora.safetensors"), seed=4)
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", lumina_files["dit"], "--gemma2", lumina_files["gemma2"], "--models",
                            lora_path, "--ratios", "1.0", "--save_to", merged]) == 0
    out = str(tmp_path / "extracted.safetensors")
    assert extract_lora_from_models.main(["--model_org", lumina_files["dit"], "--model_tuned", merged, "--gemma2",
                                          lumina_files["gemma2"], "--dim", "4", "--clamp_quantile", "1.0",
                                          "--save_to", out]) == 0
    got, base, tuned = load_file(out), load_file(lumina_files["dit"]), load_file(merged)
    names = {k.split(".")[0] for k in got}
    # the 42 block and final-layer modules and the 4 embedders (layers outside the blocks are extracted, as FLUX.1's)
    assert len(names) == 46 and "lora_unet_layers_2_attention_qkv" in names
    with safe_open(out, "pt") as f:
        assert f.metadata()["ss_network_module"] == "networks.lora_lumina"
    for name, key in (("lora_unet_layers_2_attention_qkv", "layers.2.attention.qkv.weight"),
                      ("lora_unet_final_layer_linear", "final_layer.linear.weight")):
        down, up, alpha = got[f"{name}.lora_down.weight"], got[f"{name}.lora_up.weight"], got[f"{name}.alpha"]
        torch.testing.assert_close(up.float() @ down.float() * (alpha / down.shape[0]), tuned[key] - base[key],
                                   rtol=1e-3, atol=1e-4)
