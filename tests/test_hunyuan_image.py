"""HunyuanImage 2.1: the original DiT layout against diffusers' own HunyuanVideo converter (the same block names),
the tiny preset written as the files users have and loaded back by the real loaders, sd-scripts' kohya LoRA names
(fused qkv / linear1) on the full-size model, text as sd-scripts tokenizes and encodes it, a short LoRA training run
with sampling, and sd-scripts' documented command line."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.hunyuan_image import layout
from library.families.hunyuan_image import text as text_rules
from library.families.common.dit_layout import COMFY_PREFIX
from library.families.base import (
    Components,
    LoadOptions,
    ModelLoadError,
)
from library.families.hunyuan_image.configs import build_hunyuan_image_modules
from library.families.hunyuan_image.options import HunyuanImageOptions
from networks.lora import create_network
from tests.train_helpers import (assert_close_measured, base_args, largest_lora_up, make_dataset, make_trainer,
                                 random_lora_file)


def _options(files) -> HunyuanImageOptions:
    return HunyuanImageOptions(text_encoder=files["text_encoder"], byt5=files["byt5"])


def test_original_layout_matches_diffusers_hunyuan_video_converter(tiny_hi):
    """HunyuanVideo's original checkpoint uses the same double-block, token-refiner, time and final-layer names;
    diffusers' converter for it gives our tensors back (time_text_embed is time_guidance_embed here). Its single-block
    split is hard-wired to HunyuanVideo's width 3072, so the single-block names are checked on a 3072-wide block."""
    from diffusers.loaders.single_file_utils import (
        convert_hunyuan_video_transformer_to_diffusers,
    )

    state = tiny_hi.denoiser.state_dict()
    original = layout.to_original(state)
    assert original["double_blocks.0.img_attn_qkv.weight"].shape == (3 * 32, 32)
    assert original["single_blocks.0.linear1.weight"].shape == (3 * 32 + 4 * 32, 32)
    shared = {k: v for k, v in original.items() if not k.startswith(("single_blocks.", "byt5_in."))}
    converted = convert_hunyuan_video_transformer_to_diffusers(dict(shared))
    converted = {("time_guidance_embed." + k[len("time_text_embed."):] if k.startswith("time_text_embed.") else k): v
                 for k, v in converted.items()}
    expected = {k: v for k, v in state.items() if not k.startswith(("single_transformer_blocks.", "context_embedder_2."))}
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[k], expected[k]) for k in expected)
    # a 3072-wide single block, tensors narrow on the input side: the converter's split and names against ours
    gen = torch.Generator().manual_seed(0)
    block = {"single_blocks.0.linear1.weight": torch.randn(3 * 3072 + 4 * 3072, 2, generator=gen),
             "single_blocks.0.linear1.bias": torch.randn(3 * 3072 + 4 * 3072, generator=gen),
             "single_blocks.0.linear2.weight": torch.randn(3072, 2, generator=gen),
             "single_blocks.0.modulation.linear.weight": torch.randn(3 * 3072, 2, generator=gen),
             "single_blocks.0.q_norm.weight": torch.randn(128, generator=gen),
             "single_blocks.0.k_norm.weight": torch.randn(128, generator=gen)}
    ours = layout.to_diffusers(block, 3072)
    theirs = convert_hunyuan_video_transformer_to_diffusers(dict(block))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert layout.to_original(ours).keys() == block.keys()


def test_tiny_files_load_through_the_real_loaders(hi_files, tiny_hi):
    from library.families.detect import detect_family

    with safe_open(hi_files["dit"], "pt") as f:
        keys = set(f.keys())
    assert {"double_blocks.1.txt_attn_qkv.weight", "single_blocks.3.linear1.weight", "byt5_in.fc3.weight",
            "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.bias", "final_layer.adaLN_modulation.1.weight"} <= keys
    assert not any("to_q" in k or k.startswith("model.") for k in keys)
    with safe_open(hi_files["byt5"], "pt") as f:
        assert "shared.weight" in f.keys() and "encoder.embed_tokens.weight" not in f.keys()
        assert f.get_slice("shared.weight").get_shape() == [384 + 138 + 988, 32]  # byT5 + sd-scripts' glyph tokens
    with safe_open(hi_files["vae"], "pt") as f:
        assert {"encoder.down.0.block.0.conv1.weight", "encoder.down.4.downsample.conv.weight",
                "decoder.up.4.upsample.conv.weight", "decoder.mid.attn_1.proj_out.weight"} <= set(f.keys())
    loaded = get_family("hunyuan_image").load(LoadOptions(hi_files["dit"], vae=hi_files["vae"],
                                                          family_options=_options(hi_files)))
    for a, b in ((loaded.denoiser, tiny_hi.denoiser), (loaded.vae, tiny_hi.vae),
                 (loaded.text_encoders[0], tiny_hi.text_encoders[0]), (loaded.text_encoders[1], tiny_hi.text_encoders[1])):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), type(a).__name__
    assert loaded.tokenizers[0].get_vocab() == tiny_hi.tokenizers[0].get_vocab()
    assert len(loaded.tokenizers[1]) == 1510
    assert detect_family(hi_files["dit"]) == "hunyuan_image" and detect_family("tiny:hunyuan_image") == "hunyuan_image"
    from library.families.hunyuan_image.loading import load_dit_file

    comfy = hi_files["dit"].replace(".safetensors", "-comfy.safetensors")
    save_file({COMFY_PREFIX + k: v for k, v in load_file(hi_files["dit"]).items()}, comfy)
    again = load_dit_file(comfy, torch.float32).state_dict()
    assert all(torch.equal(again[k], v) for k, v in tiny_hi.denoiser.state_dict().items())


def test_option_errors_are_one_line(hi_files):
    family = get_family("hunyuan_image")
    with pytest.raises(ModelLoadError, match=r"^--text_encoder: required with a HunyuanImage DiT file"):
        family.load(LoadOptions(hi_files["dit"]))
    with pytest.raises(ModelLoadError, match=r"^--byt5 .*: expected a byT5 text encoder \(encoder.block.\* keys\), "
                                             r"found a HunyuanImage 2.1 DiT$"):
        family.load(LoadOptions(hi_files["dit"], family_options=HunyuanImageOptions(
            text_encoder=hi_files["text_encoder"], byt5=hi_files["dit"])))
    with pytest.raises(ModelLoadError, match=r"^--vae: required with a HunyuanImage DiT file"):
        family.check_options(_options(hi_files), LoadOptions(hi_files["dit"]))
    with pytest.raises(ConfigError, match=r"^--v_parameterization: only for DDPM"):
        family.check_options(HunyuanImageOptions(), LoadOptions("tiny:hunyuan_image", v_parameterization=True))
    with pytest.raises(ConfigError, match=r"^--vae_chunk_size: expected an integer >= 1, got 0$"):
        HunyuanImageOptions(vae_chunk_size=0).check()
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 2: expected 1\.\.1 for this model \(2 double and 4 single"):
        family.check_options(_options(hi_files), LoadOptions(hi_files["dit"], vae=hi_files["vae"]), blocks_to_swap=2)


def test_full_size_lora_names_on_meta():
    """sd-scripts' networks.lora_hunyuan_image on the 17B model: every Linear of the 20 double and 40 single blocks
    under its original name (10 and 3 per block), the fused widths of its split_dims, no text-encoder LoRA."""
    from library.families.hunyuan_image.family import swap_split

    family = get_family("hunyuan_image")
    parts = build_hunyuan_image_modules("random:hunyuan_image", device="meta")
    c = Components(parts["transformer"], parts["vae"], [parts["qwen"], parts["byt5"]],
                   [parts["qwen_tokenizer"], parts["byt5_tokenizer"]])
    net = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c))
    names = [lora.lora_name for lora in net.unet_loras]
    assert len(names) == 20 * 10 + 40 * 3 == 320 and not net.text_encoder_loras
    # Independently, from the original file's keys: each 2-D weight of a double or single block.
    original = layout.to_original(c.denoiser.state_dict())
    expected = {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k, v in original.items()
                if re.match(r"(double|single)_blocks\.", k) and k.endswith(".weight") and v.dim() == 2}
    assert set(names) == expected
    ups = {lora.lora_name: lora.lora_up.weight.shape[0] for lora in net.unet_loras}
    assert ups["lora_unet_double_blocks_0_img_attn_qkv"] == ups["lora_unet_double_blocks_19_txt_attn_qkv"] == 3 * 3584
    assert ups["lora_unet_single_blocks_39_linear1"] == 3 * 3584 + 14336  # sd-scripts' [3584] * 3 + [14336]
    assert ups["lora_unet_double_blocks_3_img_mod_linear"] == 6 * 3584
    assert ups["lora_unet_single_blocks_0_modulation_linear"] == 3 * 3584
    assert {"lora_unet_double_blocks_0_txt_mlp_fc2", "lora_unet_single_blocks_0_linear2"} <= set(names)
    assert family.modelspec_architecture(c, 2048) == "hunyuan-image-2.1" == family.base_model_version(c)
    assert family.block_classes == ("HunyuanImageTransformerBlock", "HunyuanImageSingleTransformerBlock")
    assert swap_split(37, 20, 40) == (18, 38)  # sd-scripts' documented maximum
    with pytest.raises(ConfigError, match=r"^--blocks_to_swap 38: expected 1\.\.37 "):
        swap_split(38, 20, 40)
    dims = {m.lora_name: m.lora_dim for m in create_network(
        1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c),
        network_reg_dims="single_blocks_\\d+_linear1=8,img_mod=0").unet_loras}
    assert dims["lora_unet_single_blocks_5_linear1"] == 8 and dims["lora_unet_single_blocks_5_linear2"] == 4
    assert "lora_unet_double_blocks_0_img_mod_linear" not in dims and len(dims) == 300
    with pytest.raises(ConfigError, match=r"^--network_args split_qkv: not supported"):
        create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(c), split_qkv="True")


def test_text_as_sd_scripts_tokenizes_and_encodes(tiny_hi):
    family, c = get_family("hunyuan_image"), tiny_hi
    qwen_tok, byt5_tok = c.tokenizers
    assert text_rules.glyph_text('a sign "OPEN" and “营业” but not \'this\'') == 'Text "OPEN". Text "营业". '
    assert text_rules.glyph_text("a cat") is None
    captions = ['a sign saying "OPEN"', "a photo of a cat on a table"]
    qwen_ids, qwen_mask, byt5_ids, byt5_mask = family.tokenize(c, captions, None)
    drop = text_rules.template_tokens(qwen_tok)
    ref = qwen_tok(text_rules.QWEN_TEMPLATE.format(captions[1]), return_tensors="pt").input_ids[0]
    n = len(ref)
    assert qwen_ids.shape == (2, drop + 1024) and torch.equal(qwen_ids[1, :n], ref) and qwen_mask[1].sum() == n
    assert qwen_ids[1, n] == qwen_tok.pad_token_id and qwen_tok.decode(qwen_ids[1, drop:n]).startswith("a photo of")
    glyph = byt5_tok('Text "OPEN". ', padding="max_length", max_length=128, return_tensors="pt")
    assert torch.equal(byt5_ids[0], glyph.input_ids[0]) and byt5_mask[1].sum() == 0
    qwen, byt5 = c.text_encoders
    with torch.no_grad():
        text = family.encode_text(c, [qwen_ids, qwen_mask, byt5_ids, byt5_mask], None).tensors
        hidden = qwen(input_ids=ref[None], output_hidden_states=True).hidden_states
        glyph_states = byt5(input_ids=glyph.input_ids, attention_mask=glyph.attention_mask.float())[0]
    assert set(text) == set(text_rules.TEXT_KEYS)
    assert text["vlm_embed"].shape == (2, 1024, 32) and int(text["vlm_mask"][1].sum()) == n - drop
    torch.testing.assert_close(text["vlm_embed"][1, :n - drop], hidden[-3][0, drop:])
    assert not text["vlm_embed"][1, n - drop:].any() and not torch.equal(hidden[-3], hidden[-2])
    torch.testing.assert_close(text["byt5_embed"][0], glyph_states[0])
    assert not text["byt5_embed"][1].any() and text["ocr_mask"].tolist() == [True, False]


def test_predict_trims_padding_and_floors_the_timestep(tiny_hi):
    """predict on 1024 + 128 padded text equals the DiT on the untrimmed tensors at t = ⌊σ·1000⌋ (masked padding
    changes nothing), and the floor matters (t 250.9 and 250.0 give the same output)."""
    family, c = get_family("hunyuan_image"), tiny_hi
    with torch.no_grad():
        text = family.encode_text(c, family.tokenize(c, ['a sign "HI"', "a cat"], None), None)
        x = torch.randn(2, 64, 2, 2, generator=torch.Generator().manual_seed(2))
        ours = family.predict(c, x, torch.tensor([250.9, 700.2]), text, {})
        same = family.predict(c, x, torch.tensor([250.0, 700.0]), text, {})
        t = text.tensors
        direct = c.denoiser(x, torch.tensor([250.0, 700.0]), t["vlm_embed"], t["vlm_mask"], None, t["byt5_embed"],
                            t["byt5_mask"], return_dict=False)[0]
    torch.testing.assert_close(ours, direct, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours, same)


def independent_merge(original: dict, lora: dict) -> tuple[dict, int]:
    """Original-layout tensors with each lora_unet module's up @ down · alpha / rank added to the weight whose
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


def test_lora_equals_an_independent_merge_in_the_original_layout(tmp_path, tiny_hi):
    """The LoRA-patched DiT equals one whose original-layout weights (fused qkv / linear1) had up @ down · alpha /
    rank added per module, loaded back by the single-file loader."""
    from library.families.hunyuan_image.loading import load_dit_file

    family = get_family("hunyuan_image")
    c = family.load(LoadOptions("tiny:hunyuan_image"))
    path = random_lora_file(family, c, str(tmp_path / "lora.safetensors"))
    merged, used = independent_merge(layout.to_original(c.denoiser.state_dict()), load_file(path))
    assert used == 2 * 10 + 4 * 3
    file = str(tmp_path / "merged.safetensors")
    save_file(merged, file)
    reference = load_dit_file(file, torch.float32)
    net = create_network(1.0, 4, 2, c.vae, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c))
    net.load_weights(path)
    net.apply_to(c.text_encoders, c.denoiser, False, True)
    with torch.no_grad():
        text = family.encode_text(c, family.tokenize(c, ['a sign "HI"', "a cat"], None), None)
        x = torch.randn(2, 64, 2, 2, generator=torch.Generator().manual_seed(1))
        ours = family.predict(c, x, torch.tensor([250.0, 750.0]), text, {})
        theirs = family.predict(Components(reference, None, c.text_encoders, c.tokenizers, options=c.options), x,
                                torch.tensor([250.0, 750.0]), text, {})
    assert not torch.allclose(ours, family.predict(tiny_hi, x, torch.tensor([250.0, 750.0]), text, {}), atol=1e-3)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_tiny_lora_training_run_with_text_cache_and_samples(tmp_path, tiny_hi):
    import os

    from library.families.hunyuan_image.generate import hunyuan_image_sigmas
    from library.objectives.flow import shift_sigmas

    data = make_dataset(str(tmp_path), n=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a red cube saying "HI" --n blurry --w 64 --h 64 --s 2 --l 3.0 --d 5\n')
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:hunyuan_image", steps=2, extra=[
        "--network_module", "networks.lora_hunyuan_image", "--cache_text_encoder_outputs_to_disk",
        "--cache_latents_to_disk", "--network_train_unet_only", "--sample_prompts", str(prompts),
        "--sample_every_n_steps", "2"]), "hunyuan_image")
    path = trainer.run()
    import numpy as np

    folder = os.path.join(data, "5_sks toy")
    with np.load(os.path.join(folder, "img0_hi_te.npz")) as te:  # sd-scripts' suffix and keys
        assert {"vlm_embed", "vlm_mask", "byt5_embed", "byt5_mask", "ocr_mask"} <= set(te.files)
        assert te["vlm_embed"].shape == (1024, 32) and te["byt5_embed"].shape == (128, 32) and not te["ocr_mask"]
    with np.load(os.path.join(folder, "img0_0064x0064_hi.npz")) as latents:
        assert latents["latents_2x2"].shape == (64, 2, 2)  # 64 channels, 32x down
    samples = os.listdir(tmp_path / "out" / "sample")
    assert any(re.match(r"lora_000002_00_\d+_5\.png$", n) for n in samples), samples  # sampled with the TE cache
    with safe_open(path, "pt") as f:
        keys = sorted(f.keys())
        metadata = f.metadata()
        up = f.get_tensor("lora_unet_single_blocks_0_linear1.lora_up.weight")
    assert len(keys) == (2 * 10 + 4 * 3) * 3 and all(k.startswith("lora_unet_") for k in keys)
    assert up.shape == (3 * 32 + 4 * 32, 4) and up.abs().sum() > 0  # trained
    assert (metadata["ss_base_model_version"], metadata["modelspec.architecture"], metadata["ss_network_module"]) \
        == ("hunyuan-image-2.1", "hunyuan-image-2.1/lora", "networks.lora_hunyuan_image")
    assert (metadata["ss_timestep_sampling"], metadata["ss_discrete_flow_shift"],
            metadata["ss_model_prediction_type"]) == ("sigma", "5.0", "raw")  # sd-scripts' HunyuanImage defaults
    sigmas = hunyuan_image_sigmas(4, 5.0)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    torch.testing.assert_close(sigmas[2], shift_sigmas(torch.tensor(0.5, dtype=torch.float64), 5.0).float())


def test_documented_sd_scripts_command_line_runs(example_data, tmp_path, monkeypatch, capsys):  # noqa: F811
    """docs/hunyuan_image_train_network.md's sd-scripts command line trains one step on tiny:hunyuan_image with only
    the substitutions of tests/test_sd_scripts_command_lines.py (model and component paths, data, output)."""
    import os

    from library.cli.entry import run_training
    from tests import test_sd_scripts_command_lines as doc_lines

    monkeypatch.setattr(doc_lines, "DOCS", ("docs/hunyuan_image_train_network.md",))
    monkeypatch.setitem(doc_lines.SCRIPTS, "hunyuan_image_train_network.py", ("hunyuan_image", "tiny:hunyuan_image"))
    monkeypatch.setattr(doc_lines, "MODEL_PARTS", doc_lines.MODEL_PARTS | {"--text_encoder", "--byt5"})
    (where, command), = doc_lines.documented_command_lines()
    family, script, argv = doc_lines.adapt(command, *example_data, str(tmp_path / "out"))
    assert (family, script) == ("hunyuan_image", "hunyuan_image_train_network.py")
    assert "--fp8_scaled" in argv and "--split_attn" in argv and "--cache_latents" in argv
    code = run_training(family, script, argv)
    err = capsys.readouterr().err
    assert code == 0, f"{where}: {err.strip().splitlines()[-1:]}"
    saved = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    assert saved == ["my_hunyuan_lora.safetensors"]


def test_web_ui_template_uses_the_scripts_flags():
    """webui/templates/hunyuan_image_lora.toml: runs hunyuan_image_train_network.py, and every config key is a flag
    of that script (so the job's --config_file parses) with sd-scripts' documented values."""
    from library.cli.entry import build_parser
    from webui.families import script_for
    from webui.jobfiles import templates

    template = templates()["hunyuan_image_lora"]
    assert (template["template"]["family"], template["template"]["mode"]) == ("hunyuan_image", "lora")
    assert script_for("hunyuan_image", "lora") == "hunyuan_image_train_network.py"
    parser = build_parser("test", get_family("hunyuan_image"))
    dests = {a.dest for a in parser._actions}
    keys = {k: v for section in template["config"].values() for k, v in section.items()}
    assert sorted(set(keys) - dests) == []
    assert (keys["network_module"], keys["discrete_flow_shift"], keys["text_encoder"].endswith("qwen_2.5_vl_7b.safetensors"),
            keys["fp8_scaled"]) == ("networks.lora_hunyuan_image", 5.0, True, True)


def test_merge_and_extract_tools_on_the_original_files(tmp_path, hi_files, tiny_hi):
    """tools/merge_lora.py on the HunyuanImage files (--text_encoder / --byt5 as training takes them) writes the DiT
    equal to the independent merge in the original layout; extract_lora_from_models.py between the two files gets
    each module's difference back under its sd-scripts name (no clamping: --clamp_quantile 1.0)."""
    from tools import extract_lora_from_models, merge_lora

    family = get_family("hunyuan_image")
    lora_path = random_lora_file(family, tiny_hi, str(tmp_path / "lora.safetensors"), seed=4)
    parts = ["--text_encoder", hi_files["text_encoder"], "--byt5", hi_files["byt5"]]
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--sd_model", hi_files["dit"], *parts, "--models", lora_path, "--ratios", "1.0",
                            "--save_to", merged]) == 0
    expected, used = independent_merge(load_file(hi_files["dit"]), load_file(lora_path))
    got = load_file(merged)
    assert used == 32 and got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    out = str(tmp_path / "extracted.safetensors")
    assert extract_lora_from_models.main(["--model_org", hi_files["dit"], "--model_tuned", merged, *parts, "--dim", "4",
                                          "--clamp_quantile", "1.0", "--save_to", out]) == 0
    extracted, base = load_file(out), load_file(hi_files["dit"])
    assert len({k.split(".")[0] for k in extracted}) == 32
    with safe_open(out, "pt") as f:
        assert f.metadata()["ss_network_module"] == "networks.lora_hunyuan_image"
    for name, key in (("lora_unet_single_blocks_2_linear1", "single_blocks.2.linear1.weight"),
                      ("lora_unet_double_blocks_1_txt_attn_qkv", "double_blocks.1.txt_attn_qkv.weight")):
        down, up, alpha = (extracted[f"{name}.{k}"] for k in ("lora_down.weight", "lora_up.weight", "alpha"))
        torch.testing.assert_close(up @ down * (alpha / down.shape[0]), got[key] - base[key], rtol=1e-3, atol=1e-4)


def test_block_swap_and_offloaded_checkpointing_train_as_without(tmp_path, tiny_hi):
    """--blocks_to_swap 1 (the last two single blocks streamed) with --cpu_offload_checkpointing gives the LoRA of
    plain gradient checkpointing up to float rounding (diffusers' HunyuanImage blocks take keyword inputs through
    both checkpointing functions); the streamed blocks are the last N//2 double and 2·(N − N//2) single ones."""
    data = make_dataset(str(tmp_path), n=1)
    extra = ["--network_module", "networks.lora_hunyuan_image", "--gradient_checkpointing"]
    runs = [make_trainer(base_args(data, str(tmp_path / name), "tiny:hunyuan_image", steps=1, extra=extra + more),
                         "hunyuan_image").run()
            for name, more in (("plain", []), ("swap", ["--blocks_to_swap", "1", "--cpu_offload_checkpointing"]))]
    a, b = (load_file(p) for p in runs)
    # measured 0 with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY); 3e-5 leaves room for
    # kernels that depend on alignment. The swapped blocks' weights (the saved inputs) copied through float16 give
    # 6.4e-5 (4.5e-5), zeros in place of the weights 2e-3
    assert_close_measured(b, a, 3e-5, "hunyuan swap + offload vs plain: LoRA")
    assert largest_lora_up(a) > 5e-4  # trained: one AdamW step at 1e-3 moves it 1e-3
    assert not torch.equal(a["lora_unet_single_blocks_3_linear1.lora_up.weight"],
                           torch.zeros_like(a["lora_unet_single_blocks_3_linear1.lora_up.weight"]))
    blocks = get_family("hunyuan_image").swappable_blocks(tiny_hi, 1)
    assert blocks == list(tiny_hi.denoiser.single_transformer_blocks)[2:]


def test_comfyui_named_lora_files_read_as_sd_scripts_names(tmp_path, tiny_hi):
    """sd-scripts' convert_hunyuan_image_lora_to_comfy.py renames img/txt_mlp_fc1/fc2 to _0/_2 and *_mod_linear /
    modulation_linear to *_lin; such a file comes back in sd-scripts' names (and one already in them unchanged)."""
    family = get_family("hunyuan_image")
    original = load_file(random_lora_file(family, tiny_hi, str(tmp_path / "lora.safetensors")))
    comfy_table = (("img_mlp_fc1", "img_mlp_0"), ("img_mlp_fc2", "img_mlp_2"), ("img_mod_linear", "img_mod_lin"),
                   ("txt_mlp_fc1", "txt_mlp_0"), ("txt_mlp_fc2", "txt_mlp_2"), ("txt_mod_linear", "txt_mod_lin"),
                   ("modulation_linear", "modulation_lin"))
    comfy = {}
    for key, value in original.items():
        for ours, theirs in comfy_table:
            key = key.replace(ours, theirs)
        comfy[key] = value
    assert "lora_unet_double_blocks_1_txt_mod_lin.alpha" in comfy and len(set(comfy) - set(original)) == 2 * 6 * 3 + 4 * 1 * 3
    back = family.convert_lora_state_dict(comfy)
    assert back.keys() == original.keys() and all(back[k] is original[k] for k in original)
    assert family.convert_lora_state_dict(original) is original
