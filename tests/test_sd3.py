"""SD3 / SD3.5 family: the SAI layout against diffusers' converter, tiny files through the real loaders, golden
LoRA key counts on the meta device, the fused qkv LoRA against an independent merge, a tiny LoRA run and a
full fine-tune round trip.

ComfyUI's key layout: ComfyUI's LoRA loader (comfy/lora.py model_lora_keys_unet for SD3) maps
`lora_unet_<SAI path with "_">` onto the `diffusion_model.<SAI path>.weight` of its own MMDiT, which has
the SAI names and the fused `qkv`; `lora_te1_` / `lora_te2_` / `lora_te3_` onto clip_l / clip_g / t5xxl.
Those are exactly the names checked below (SAI paths derived from the single-file keys).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.sd3 import layout as sai
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.sd3.configs import PRESETS, build_sd3_modules, transformer_config
from library.families.sd3.options import SD3Options
from library.families.sd3.pos_embed import ScaledPositions
from library.families.sd3.saving import write_sd3_preset
from library.objectives.flow_sd3 import SD3FlowOptions
from networks.lora import create_network
from tests.train_helpers import base_args, make_dataset, make_trainer, random_lora_file


@pytest.fixture(scope="module")
def sd3_files(tmp_path_factory):
    """tiny:sd3 written in every layout: SAI all-in-one, SAI MMDiT+VAE with separate text encoders, diffusers."""
    root = tmp_path_factory.mktemp("sd3-files")
    parts = build_sd3_modules("tiny:sd3")
    return {"single": write_sd3_preset("tiny:sd3", str(root / "single.safetensors"), "single_file", parts)["model"],
            "separate": write_sd3_preset("tiny:sd3", str(root / "separate"), "separate", parts),
            "folder": write_sd3_preset("tiny:sd3", str(root / "folder"), "diffusers", parts)["folder"]}


def _states(c: Components) -> dict[str, dict[str, torch.Tensor]]:
    parts = {"denoiser": c.denoiser, "vae": c.vae, **{f"te{i}": m for i, m in enumerate(c.text_encoders)}}
    return {n: m.state_dict() for n, m in parts.items()}


def _assert_same_model(a: Components, b: Components) -> None:
    sa, sb = _states(a), _states(b)
    for part in sa:
        assert sa[part].keys() == sb[part].keys(), part
        bad = [k for k in sa[part] if not torch.equal(sa[part][k], sb[part][k])]
        assert not bad, f"{part}: {bad[:3]}"


def test_sai_layout_round_trips_through_diffusers_converter():
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_sd3_transformer_checkpoint_to_diffusers,
    )

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**transformer_config(PRESETS["tiny:sd3"]))  # diffusers' own order
    state = transformer.state_dict()
    sai_state = sai.diffusers_to_sai(state)
    assert "joint_blocks.0.x_block.attn.qkv.weight" in sai_state and "joint_blocks.0.x_block.attn2.ln_q.weight" in sai_state
    assert "joint_blocks.2.context_block.attn.proj.weight" not in sai_state  # the last block's context is pre-only
    theirs = convert_sd3_transformer_checkpoint_to_diffusers({sai.SAI_PREFIX + k: v.clone() for k, v in sai_state.items()})
    ours = sai.sai_to_diffusers(sai_state)
    for converted in (theirs, ours):
        assert converted.keys() == state.keys()
        assert all(torch.equal(converted[k], state[k]) for k in state)
    assert sai.infer_transformer_config(sai_state) == {**transformer_config(PRESETS["tiny:sd3"]), "sample_size": 128}


def test_tiny_files_load_through_the_real_loaders(sd3_files, tiny_sd3):
    family = get_family("sd3")
    single = family.load(LoadOptions(sd3_files["single"]))
    sep = sd3_files["separate"]
    separate = family.load(LoadOptions(sep["model"], family_options=SD3Options(
        clip_l=sep["clip_l"], clip_g=sep["clip_g"], t5xxl=sep["t5xxl"])))
    folder = family.load(LoadOptions(sd3_files["folder"]))
    for loaded in (single, separate, folder):
        assert sai.in_sai_order(loaded.denoiser)
        _assert_same_model(loaded, tiny_sd3)
    with safe_open(sd3_files["single"], "pt") as f:
        keys = set(f.keys())
    assert {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "first_stage_model.encoder.conv_in.weight",
            "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight",
            "text_encoders.clip_g.transformer.text_projection.weight",
            "text_encoders.t5xxl.transformer.shared.weight"} <= keys
    # diffusers' own pipeline reads the folder we wrote
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_files["folder"])
    ours = sai.diffusers_state_dict(tiny_sd3.denoiser)
    assert all(torch.equal(v, ours[k]) for k, v in pipe.transformer.state_dict().items())
    # a transformer-only file without the text-encoder flags: one line, before any weight is read
    with pytest.raises(ConfigError, match=r"^--clip_l: required, .* holds no clip_l text encoder; give a CLIP-L"):
        family.check_options(SD3Options(), LoadOptions(sep["model"]))
    with pytest.raises(ModelLoadError, match="unknown SD3 preset 'tiny:flux'"):
        family.load(LoadOptions("tiny:flux"))
    from library.families.detect import detect_family

    assert [detect_family(p) for p in (sd3_files["single"], sep["model"], sd3_files["folder"], "tiny:sd3")] == ["sd3"] * 4


def test_option_errors_are_one_line():
    family = get_family("sd3")
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 2: expected 1\.\.1 for this model \(3 joint blocks"):
        family.check_options(SD3Options(), LoadOptions("tiny:sd3"), blocks_to_swap=2)
    with pytest.raises(ConfigError, match="^--weighting_scheme: expected one of sigma_sqrt, logit_normal"):
        SD3Options(flow=SD3FlowOptions(weighting_scheme="sigmoid")).check()
    with pytest.raises(ConfigError, match="^--t5_dropout_rate: expected a number from 0 to 1, got 1.5"):
        SD3Options(t5_dropout_rate=1.5).check()


def _meta_components(preset: str, text_encoders: bool) -> Components:
    if text_encoders:
        parts = build_sd3_modules(preset, device="meta")
        return Components(parts["transformer"], parts["vae"],
                          [parts["text_encoder"], parts["text_encoder_2"], parts["text_encoder_3"]],
                          [parts["tokenizer"], parts["tokenizer_2"], parts["tokenizer_3"]])
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        return Components(SD3Transformer2DModel(**transformer_config(PRESETS[preset])), None, [], [])


@pytest.mark.parametrize("preset,unet_modules,arch", [("random:sd3-medium", 237, "stable-diffusion-3-medium"),
                                                      ("random:sd3.5-medium", 263, "stable-diffusion-3-5-medium"),
                                                      ("random:sd3.5-large", 377, "stable-diffusion-3-5-large")])
def test_full_size_lora_names_on_meta(preset, unet_modules, arch):
    family = get_family("sd3")
    c = _meta_components(preset, text_encoders=preset == "random:sd3-medium")
    targets = family.lora_targets(c) + ([family.t5_lora_target(c)] if c.text_encoders else [])
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=targets)
    names = [lora.lora_name for lora in net.unet_loras]
    assert len(names) == unet_modules
    # sd-scripts' rule, computed independently from the SAI single-file keys: every Linear (2-D weight) inside a
    # joint block's x_block / context_block gets a module named lora_unet_<path with "_">.
    sai_keys = [sai.diffusers_key_to_sai(k)[0] for k in c.denoiser.state_dict()]
    expected = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k in sai_keys
                if re.match(r"joint_blocks\.\d+\.(x|context)_block\.", k) and k.endswith(".weight")
                and not re.search(r"\.ln_[qk]\.", k)}
    assert set(names) == expected
    if c.text_encoders:  # the same CLIP-L, CLIP-G and T5-XXL in every SD3 / SD3.5
        te = [lora.lora_name for lora in net.text_encoder_loras]
        assert [sum(n.startswith(p) for n in te) for p in ("lora_te1_", "lora_te2_", "lora_te3_")] == [72, 192, 168]
        assert "lora_te2_text_model_encoder_layers_31_mlp_fc2" in te
        assert "lora_te3_encoder_block_23_layer_1_DenseReluDense_wo" in te
    hidden = c.denoiser.config.num_attention_heads * 64
    ups = {lora.lora_name: lora.lora_up.weight.shape[0] for lora in net.unet_loras}
    last = c.denoiser.config.num_layers - 1
    assert ups["lora_unet_joint_blocks_0_x_block_attn_qkv"] == 3 * hidden
    assert ups["lora_unet_joint_blocks_0_context_block_adaLN_modulation_1"] == 6 * hidden
    assert ups[f"lora_unet_joint_blocks_{last}_context_block_adaLN_modulation_1"] == 2 * hidden
    assert f"lora_unet_joint_blocks_{last}_context_block_attn_proj" not in ups
    assert family.modelspec_architecture(c, 1024) == arch


def test_lora_equals_an_independent_merge_in_the_sai_layout(tmp_path, tiny_sd3_copy):
    """The LoRA-patched transformer equals one whose SAI-layout weights had each module's up @ down · alpha / rank
    added, converted by diffusers' own single-file converter (fused qkv rows and the swapped pre-only adaLN included)."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_sd3_transformer_checkpoint_to_diffusers,
    )

    family, c = get_family("sd3"), tiny_sd3_copy
    path = random_lora_file(family, c, str(tmp_path / "lora.safetensors"))
    lora = load_file(path)
    base = sai.diffusers_to_sai(sai.diffusers_state_dict(c.denoiser))
    merged = dict(base)
    used = set()
    for key in lora:
        if key.startswith("lora_unet_") and key.endswith(".lora_down.weight"):
            name = key[:-len(".lora_down.weight")]
            down, up, alpha = lora[key], lora[f"{name}.lora_up.weight"], lora[f"{name}.alpha"]
            target = re.sub(r"^joint_blocks_(\d+)_(x|context)_block_", r"joint_blocks.\1.\2_block.", name[len("lora_unet_"):])
            target = target.replace("adaLN_modulation_1", "adaLN_modulation.1").replace("attn2_", "attn2.") \
                .replace("attn_", "attn.").replace("mlp_", "mlp.") + ".weight"
            merged[target] = merged[target] + up @ down * (alpha / down.shape[0])
            used.add(name)
    assert len(used) == 29
    reference = SD3Transformer2DModel(**transformer_config(PRESETS["tiny:sd3"]))
    reference.load_state_dict(convert_sd3_transformer_checkpoint_to_diffusers(
        {sai.SAI_PREFIX + k: v.clone() for k, v in merged.items()}))
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
    net.load_weights(path)
    net.apply_to(c.text_encoders, c.denoiser, False, True)
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(2, 12, 32, generator=gen)
    pooled, t = torch.randn(2, 96, generator=gen), torch.tensor([250.0, 750.0])
    with torch.no_grad():
        ours = c.denoiser(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t).sample
        theirs = reference(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t).sample
    net.restore()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_tiny_sd3_lora_training_run(tmp_path):
    data = make_dataset(str(tmp_path), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:sd3", steps=2, extra=[
        "--network_module", "networks.lora_sd3", "--t5xxl_max_token_length", "8", "--cache_text_encoder_outputs",
        "--network_train_unet_only", "--weighting_scheme", "logit_normal", "--logit_mean", "0.5",
        "--apply_t5_attn_mask", "--clip_l_dropout_rate", "0.5", "--enable_scaled_pos_embed",
        "--pos_emb_random_crop_rate", "0.5"]), "sd3")
    path = trainer.run()
    assert isinstance(trainer.components.denoiser.pos_embed.cropped_pos_embed, ScaledPositions)
    with safe_open(path, "pt") as f:
        keys = sorted(f.keys())
        metadata = f.metadata()
        up = f.get_tensor("lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight")
    assert len(keys) == 29 * 3 and all(k.startswith("lora_unet_joint_blocks_") for k in keys)
    assert up.shape == (3 * 128, 4) and up.abs().sum() > 0  # trained
    assert (metadata["ss_base_model_version"], metadata["modelspec.architecture"], metadata["ss_network_module"]) \
        == ("5-medium", "stable-diffusion-3-5-medium/lora", "networks.lora_sd3")
    assert (metadata["ss_weighting_scheme"], metadata["ss_logit_mean"], metadata["ss_apply_t5_attn_mask"],
            metadata["ss_apply_lg_attn_mask"]) == ("logit_normal", "0.5", "True", "False")


def test_full_fine_tune_saves_a_single_file_that_loads_back(tmp_path):
    from library.cli.entry import run_training
    from tests.train_helpers import ft_args

    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "out")
    assert run_training("sd3", "test", ft_args(data, out, preset="tiny:sd3", steps=1, extra=[
        "--t5xxl_max_token_length", "8", "--train_text_encoder"]), fine_tune=True) == 0
    path = os.path.join(out, "model.safetensors")
    family = get_family("sd3")
    loaded = family.load(LoadOptions(path))
    base = family.load(LoadOptions("tiny:sd3"))
    a, b = loaded.denoiser.state_dict(), base.denoiser.state_dict()
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(k.startswith("transformer_blocks.") or "embed" in k or k.startswith(("norm_out", "proj_out"))
                           for k in changed)
    # --train_text_encoder trains CLIP-L and CLIP-G, not T5 (as sd-scripts' sd3_train.py)
    moved = [any(not torch.equal(x, y) for x, y in zip(m.state_dict().values(), n.state_dict().values()))
             for m, n in zip(loaded.text_encoders, base.text_encoders)]
    assert moved == [True, True, False]
    # saved again as a diffusers folder it reads back equal
    family.save_checkpoint(loaded, str(tmp_path / "folder"))
    again = family.load(LoadOptions(str(tmp_path / "folder")))
    _assert_same_model(again, loaded)


def test_sd3_timestep_scheme_matches_sd_scripts_formula():
    from library.objectives.flow_sd3 import SD3FlowScheme

    scheme = SD3FlowScheme(SD3FlowOptions(weighting_scheme="uniform", training_shift=3.0))
    gen = torch.Generator().manual_seed(0)
    t = scheme.sample_timesteps(5, min_timestep=100, max_timestep=900, generator=gen)
    u = torch.rand(5, generator=torch.Generator().manual_seed(0))
    u = u * 3 / (1 + 2 * u)
    assert torch.equal(t, (u * 800 + 100).long().float())
    latents, noise = torch.randn(5, 4, 2, 2), torch.randn(5, 4, 2, 2)
    noisy = scheme.add_noise(latents, noise, t)
    velocity = noise - latents  # a perfect velocity prediction gives x0 back exactly
    torch.testing.assert_close(scheme.prediction(velocity, noisy, t), scheme.target(latents, noise, t))
    assert torch.equal(SD3FlowScheme(SD3FlowOptions(weighting_scheme="sigma_sqrt")).loss_weights(t), (t / 1000) ** -2)


def test_diffusers_load_lora_weights_after_conversion(tmp_path, tiny_sd3_copy):
    """diffusers 0.42's StableDiffusion3Pipeline.load_lora_weights has no converter for kohya SD3 files: it loads
    such a file without an error and without using one key (checked below). tools/convert_lora.py --to diffusers
    writes the PEFT layout it does read: every key used, outputs equal to our networks.lora on the same file;
    --to kohya turns it back into the same kohya modules."""
    import copy

    from diffusers import StableDiffusion3Pipeline

    from library.families.sd3 import saving as sd3_saving
    from library.families.lora_convert import convert

    family, c = get_family("sd3"), tiny_sd3_copy
    path = random_lora_file(family, c, str(tmp_path / "lora.safetensors"))
    kohya = load_file(path)
    parts = sd3_saving.pipeline_folder(family._parts(copy.deepcopy(c)))[0]
    with sai.diffusers_order(parts["transformer"]):
        pipe = StableDiffusion3Pipeline(**parts)
        pipe.load_lora_weights(dict(kohya))
        assert pipe.get_list_adapters() == {}  # the kohya file: nothing loaded
        peft = convert(kohya, "diffusers", path)
        assert len(peft) == 2 * (43 + 72 + 192)  # 29 kohya modules are 43 diffusers projections
        back = convert(peft, "kohya", "peft")  # and back: the same modules and ΔW, q/k/v fused again on one down
        names = {k.split(".")[0] for k in kohya}
        assert {k.split(".")[0] for k in back} == names
        for n in names:
            delta = [f[n + ".lora_up.weight"] @ f[n + ".lora_down.weight"] * (f[n + ".alpha"] / f[n + ".lora_down.weight"].shape[0])
                     for f in (kohya, back)]
            torch.testing.assert_close(delta[1], delta[0], rtol=1e-5, atol=1e-6)
        assert back["lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight"].shape == (4, 128)
        pipe.load_lora_weights(peft)
        loaded = {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}
        assert len(loaded) == 43
        net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
        net.load_weights(path)
        net.apply_to(c.text_encoders, c.denoiser, True, True)
        gen = torch.Generator().manual_seed(2)
        x, ctx = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(2, 12, 32, generator=gen)
        pooled, t = torch.randn(2, 96, generator=gen), torch.tensor([100.0, 900.0])
        ids = family.tokenize(c, ["sks toy, a photo"], None)
        with torch.no_grad():
            ours = c.denoiser(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t).sample
            theirs = pipe.transformer(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled,
                                      timestep=t).sample
            for mine, their in zip(c.text_encoders[:2], (pipe.text_encoder, pipe.text_encoder_2)):
                torch.testing.assert_close(mine(ids[0], output_hidden_states=True).hidden_states[-2],
                                           their(ids[0], output_hidden_states=True).hidden_states[-2])
        net.restore()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_documented_sd_scripts_command_line_runs(example_data, tmp_path, monkeypatch, capsys):  # noqa: F811
    """docs/sd3_train_network.md's sd-scripts command line trains one step on tiny:sd3 with only the
    substitutions of tests/test_sd_scripts_command_lines.py (model and component paths, data, output)."""
    from library.cli.entry import run_training
    from tests import test_sd_scripts_command_lines as doc_lines

    monkeypatch.setattr(doc_lines, "DOCS", ("docs/sd3_train_network.md",))
    monkeypatch.setitem(doc_lines.SCRIPTS, "sd3_train_network.py", ("sd3", "tiny:sd3"))
    monkeypatch.setattr(doc_lines, "MODEL_PARTS", doc_lines.MODEL_PARTS | {"--clip_g"})
    (where, command), = doc_lines.documented_command_lines()
    family, script, argv = doc_lines.adapt(command, *example_data, str(tmp_path / "out"))
    assert (family, script) == ("sd3", "sd3_train_network.py")
    code = run_training(family, script, argv)
    err = capsys.readouterr().err
    assert code == 0, f"{where}: {err.strip().splitlines()[-1:]}"
    saved = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    assert saved == ["my_sd3_lora.safetensors"]


def test_context_layout_and_caption_dropout_per_encoder():
    """[CLIP-L | CLIP-G | zeros] over 77 tokens, then T5's tokens; pooled [L | G]; a dropped encoder's part is zero."""
    from library.families.base import TextConditioning

    family = get_family("sd3")
    gen = torch.Generator().manual_seed(3)
    t = {"l_out": torch.randn(2, 77, 4, generator=gen), "l_pooled": torch.randn(2, 4, generator=gen),
         "clip_l_attn_mask": torch.ones(2, 77), "g_out": torch.randn(2, 77, 6, generator=gen),
         "g_pooled": torch.randn(2, 6, generator=gen), "clip_g_attn_mask": torch.ones(2, 77),
         "t5_out": torch.randn(2, 5, 16, generator=gen), "t5_attn_mask": torch.ones(2, 5)}
    plain = Components(None, None, [], [], options=SD3Options())
    context, pooled = family.context(plain, TextConditioning(dict(t)), {}, "cpu", torch.float32)
    assert context.shape == (2, 82, 16) and pooled.shape == (2, 10)
    assert torch.equal(context[:, :77, :4], t["l_out"]) and torch.equal(context[:, :77, 4:10], t["g_out"])
    assert not context[:, :77, 10:].any() and torch.equal(context[:, 77:], t["t5_out"])
    dropping = Components(None, None, [], [], options=SD3Options(clip_l_dropout_rate=1.0))
    with torch.enable_grad():
        context, pooled = family.context(dropping, TextConditioning(dict(t)), {"noise_seeds": [1, 2]}, "cpu",
                                         torch.float32)
    assert not context[:, :77, :4].any() and not pooled[:, :4].any()
    assert torch.equal(context[:, :77, 4:10], t["g_out"]) and torch.equal(pooled[:, 4:], t["g_pooled"])
    with torch.no_grad():  # generation and validation: nothing dropped
        context, _ = family.context(dropping, TextConditioning(dict(t)), {}, "cpu", torch.float32)
    assert torch.equal(context[:, :77, :4], t["l_out"])


def test_scaled_position_embeddings(tiny_sd3_copy):
    """--enable_scaled_pos_embed: at a training resolution the centred crop is the plain sin-cos embedding of the
    base 16-unit span over that many patches (what the scaling is for); other buckets crop the same grid."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    family, c = get_family("sd3"), tiny_sd3_copy
    c.options = SD3Options(enable_scaled_pos_embed=True)
    family.prepare_for_data(c, [(128, 128)])  # latent 16, 8x8 patches, a 12x12 grid
    embed = c.denoiser.pos_embed
    plain = get_2d_sincos_pos_embed(128, 8, base_size=16, interpolation_scale=1.0, output_type="pt")
    torch.testing.assert_close(embed.cropped_pos_embed(16, 16)[0], plain.float(), rtol=1e-5, atol=1e-5)
    wide = embed.cropped_pos_embed(8, 16)[0].reshape(4, 8, 128)  # a 64x128 bucket: rows 4..7 of the 12x12 grid
    grid = embed.cropped_pos_embed.grids[8].reshape(12, 12, 128)
    torch.testing.assert_close(wide, grid[4:8, 2:10])
    x = torch.randn(1, 16, 8, 16)
    with torch.no_grad():  # the model runs with it
        out = c.denoiser(hidden_states=x, encoder_hidden_states=torch.randn(1, 4, 32),
                         pooled_projections=torch.randn(1, 96), timestep=torch.tensor([500.0])).sample
    assert out.shape == x.shape


def test_cache_tools_take_sd3_from_the_model_path(sd3_files):
    """sd-scripts' cache tools select SDXL / FLUX.1 by --sdxl / --flux and have no SD3 selector; here an SD3 model
    path selects the family itself (SD 1.x/2.x, SDXL and FLUX.1 paths keep the flag rule)."""
    from library.cli.cache_tools import family_name

    for path in (sd3_files["single"], sd3_files["folder"], "tiny:sd3"):
        assert family_name(["--pretrained_model_name_or_path", path, "--skip_existing"]) == \
            ("sd3", ["--pretrained_model_name_or_path", path])
    assert family_name(["--pretrained_model_name_or_path", "tiny:sdxl"])[0] == "sd"


def test_generation_schedule_and_images(tiny_sd3):
    """sd-scripts' SD3 sampler σ: timesteps evenly from 1000 to the shift-3 schedule's smallest (σ(1)·1000), each
    shifted, then 0; generated images are the requested size and the same for a seed, in a batch or not."""
    import numpy as np

    from library.families.sd3.generate import sd3_sigmas
    from library.sampling.generate import GenerationRequest

    def shift(t):
        return 3 * t / (1 + 2 * t)

    ts = np.linspace(1000, shift(1 / 1000) * 1000, 4)
    expected = [shift(t / 1000) for t in ts] + [0.0]
    torch.testing.assert_close(sd3_sigmas(4), torch.tensor(expected, dtype=torch.float32))
    family = get_family("sd3")
    request = GenerationRequest("sks toy, a photo", negative_prompt="blurry", seed=5, width=80, height=64, steps=2,
                                scale=4.0)
    one = family.generate(tiny_sd3, [request])[0]
    two = family.generate(tiny_sd3, [request, GenerationRequest("a dog", seed=6, width=80, height=64, steps=2,
                                                                scale=4.0)])
    assert one.image.size == (80, 64) and (one.request.steps, one.request.scale) == (2, 4.0)
    a, b, c = (np.asarray(x.image).astype(int) for x in (one, *two))
    assert np.abs(a - b).max() <= 2  # batched or not: the same image up to float rounding in the kernels
    assert np.abs(b - c).max() > 20
