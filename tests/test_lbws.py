"""svd_merge_lora --lbws: LoRA Block Weight lists mapped onto kohya module names, merged, and refused when wrong."""

import importlib

import pytest
import torch
from safetensors.torch import load_file

from library.core.errors import ConfigError
from networks.lora_block_weights import module_block_weights, parse_lbw, standards
from networks.lora_files import LoraModule, save_lora_file
from networks.lora_merge import WeightedLora, svd_merge

SD_NAMES = {  # kohya name -> its block
    "lora_te_text_model_encoder_layers_0_mlp_fc1": "BASE",
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q": "IN01",
    "lora_unet_down_blocks_0_resnets_1_conv1": "IN02",
    "lora_unet_down_blocks_0_downsamplers_0_conv": "IN03",
    "lora_unet_down_blocks_3_resnets_1_conv2": "IN11",
    "lora_unet_mid_block_attentions_0_proj_in": "M00",
    "lora_unet_up_blocks_0_resnets_2_conv1": "OUT02",
    "lora_unet_up_blocks_1_attentions_0_proj_out": "OUT03",
    "lora_unet_up_blocks_1_upsamplers_0_conv": "OUT05",
    "lora_unet_up_blocks_3_attentions_2_proj_out": "OUT11",
    "lora_unet_conv_in": None,  # in no block (only LyCORIS' full preset trains it)
}
SDXL_NAMES = {
    "lora_te1_text_model_encoder_layers_0_mlp_fc1": "BASE",
    "lora_te2_text_model_encoder_layers_0_self_attn_q_proj": "BASE",
    "lora_unet_time_embed_0": "IN00",
    "lora_unet_label_emb_0_0": "IN00",
    "lora_unet_input_blocks_1_0_in_layers_2": "IN01",
    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q": "IN04",
    "lora_unet_input_blocks_8_1_proj_in": "IN08",
    "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_k": "M00",
    "lora_unet_middle_block_2_in_layers_2": "M00",
    "lora_unet_output_blocks_0_1_proj_out": "OUT00",
    "lora_unet_output_blocks_5_1_transformer_blocks_1_ff_net_2": "OUT05",
    "lora_unet_output_blocks_8_0_skip_connection": "OUT08",
    "lora_unet_out_2": "OUT08",
}


def _run(argv):
    return importlib.import_module("tools.svd_merge_lora").main(argv)


def _modules(names, seed=0, rank=2):
    g = torch.Generator().manual_seed(seed)
    return {n: LoraModule(n, torch.randn(rank, 8, generator=g), torch.randn(12, rank, generator=g), 1.0) for n in names}


def _write(path, modules):
    save_lora_file(str(path), modules.values(), {"ss_network_dim": "2", "ss_network_alpha": "1"})
    return str(path)


def test_block_orders_of_the_four_standards():
    s = standards()
    assert s[26].blocks == ("BASE", "IN00", "IN01", "IN02", "IN03", "IN04", "IN05", "IN06", "IN07", "IN08", "IN09",
                            "IN10", "IN11", "M00", "OUT00", "OUT01", "OUT02", "OUT03", "OUT04", "OUT05", "OUT06",
                            "OUT07", "OUT08", "OUT09", "OUT10", "OUT11")
    assert s[17].blocks == ("BASE", "IN01", "IN02", "IN04", "IN05", "IN07", "IN08", "M00", "OUT03", "OUT04", "OUT05",
                            "OUT06", "OUT07", "OUT08", "OUT09", "OUT10", "OUT11")
    assert s[20].blocks == ("BASE", "IN00", "IN01", "IN02", "IN03", "IN04", "IN05", "IN06", "IN07", "IN08", "M00",
                            "OUT00", "OUT01", "OUT02", "OUT03", "OUT04", "OUT05", "OUT06", "OUT07", "OUT08")
    assert s[12].blocks == ("BASE", "IN04", "IN05", "IN07", "IN08", "M00", "OUT00", "OUT01", "OUT02", "OUT03",
                            "OUT04", "OUT05")
    assert {n: (v.model, len(v.blocks)) for n, v in s.items()} == {
        26: ("SD 1.x/2.x", 26), 17: ("SD 1.x/2.x", 17), 20: ("SDXL", 20), 12: ("SDXL", 12)}


@pytest.mark.parametrize("length, names, expected", [
    (26, SD_NAMES, [0, 2, 3, 4, 12, 13, 16, 17, 19, 25, 1]),
    (17, SD_NAMES, [100, 101, 102, 1, 1, 107, 1, 108, 110, 116, 1]),  # IN03, IN11, OUT02 are not in the list
    (20, SDXL_NAMES, [0, 0, 1, 1, 2, 5, 9, 10, 10, 11, 16, 19, 19]),
    (12, SDXL_NAMES, [100, 100, 1, 1, 1, 101, 104, 105, 105, 106, 111, 1, 1]),
])
def test_each_module_gets_the_weight_of_its_block(length, names, expected):
    weights = list(range(length)) if length in (26, 20) else [100 + i for i in range(length)]
    got = module_block_weights(weights, names, "x.safetensors")
    assert list(got.values()) == [float(w) for w in expected]
    assert [standards()[length].block_of(n) for n in names] == list(names.values())


def test_lbw_text_in_both_spellings():
    assert parse_lbw("1,0,0.5,1,1,1,1,1,1,1,1,1") == [1.0, 0.0, 0.5] + [1.0] * 9
    assert parse_lbw("[1, 0, 0.5, 1,1,1,1,1,1,1,1,1]") == [1.0, 0.0, 0.5] + [1.0] * 9


def test_zero_base_equals_merging_without_the_text_encoder(tmp_path):
    lora = _modules(SD_NAMES)
    full = _write(tmp_path / "full.safetensors", lora)
    unet_only = _write(tmp_path / "unet.safetensors", {n: m for n, m in lora.items() if n.startswith("lora_unet")})
    lbw = ",".join(["0"] + ["1"] * 25)
    assert _run(["--models", full, "--lbws", lbw, "--new_rank", "2", "--save_to", str(tmp_path / "a.safetensors")]) == 0
    assert _run(["--models", unet_only, "--new_rank", "2", "--save_to", str(tmp_path / "b.safetensors")]) == 0
    a, b = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    assert sorted(a) == sorted(b) and not [k for k in a if k.startswith("lora_te")]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_all_ones_equals_no_lbws(tmp_path):
    a_file = _write(tmp_path / "a.safetensors", _modules(SDXL_NAMES, seed=1))
    b_file = _write(tmp_path / "b.safetensors", _modules(SDXL_NAMES, seed=2))
    common = ["--models", a_file, b_file, "--ratios", "1", "-0.5", "--new_rank", "3"]
    assert _run(common + ["--lbws", "1," * 19 + "1", "[" + "1," * 11 + "1]",
                          "--save_to", str(tmp_path / "with.safetensors")]) == 0
    assert _run(common + ["--save_to", str(tmp_path / "without.safetensors")]) == 0
    with_, without = load_file(str(tmp_path / "with.safetensors")), load_file(str(tmp_path / "without.safetensors"))
    assert sorted(with_) == sorted(without)
    assert all(torch.equal(with_[k], without[k]) for k in with_)


def test_block_weights_multiply_into_each_models_ratio():
    a, b = _modules(SD_NAMES, seed=1), _modules(SD_NAMES, seed=2)
    wa = module_block_weights([1.0] * 13 + [0.5] + [1.0] * 12, a, "a")  # M00 at half
    wb = module_block_weights([1.0] * 13 + [0.0] + [2.0] * 12, b, "b")  # M00 off, OUT blocks doubled
    merged = {m.name: m for m in svd_merge([WeightedLora(a, 1.0, "a", wa), WeightedLora(b, -0.5, "b", wb)],
                                           new_rank=4)}
    mid, out = "lora_unet_mid_block_attentions_0_proj_in", "lora_unet_up_blocks_1_attentions_0_proj_out"
    torch.testing.assert_close(merged[mid].delta(), 0.5 * a[mid].delta(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged[out].delta(), a[out].delta() - b[out].delta(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--lbws", "1,0,1"], "--lbws[0]: expected 17 or 26 values for SD 1.x/2.x, 12 or 20 for SDXL (FLUX.1 has no "
                          "block-weight standard), got 3 in '1,0,1'"),
    (["--lbws", "1,x"], "--lbws[0]: expected comma-separated numbers like 1,0,0.5, got '1,x'"),
    (["--lbws", "1," * 25 + "1", "1," * 25 + "1"], "--lbws: expected one list per --models file (1), got 2"),
    (["--lbws", "1," * 19 + "1"], "--lbws: 20 values are for SDXL LoRAs, but the UNet modules of {sd} (e.g. lora_"
                                  "unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q) are not in its blocks; expected 17 or 26 values for SD 1.x/2.x, "
                                  "12 or 20 for SDXL (FLUX.1 has no block-weight standard)"),
    (["--lbws", "0," * 25 + "0"], "--lbws: every block of every model is weighted 0; nothing to merge"),
])
def test_bad_lbws_are_one_line_errors(tmp_path, capsys, argv, message):
    sd = _write(tmp_path / "sd.safetensors", _modules([n for n, block in SD_NAMES.items() if block]))
    out = tmp_path / "o.safetensors"
    assert _run(["--models", sd, "--new_rank", "2", "--save_to", str(out)] + argv) == 2
    assert capsys.readouterr().err == f"error: {message.format(sd=sd)}\n"
    assert not out.exists()


def test_flux_loras_have_no_block_weight_standard():
    flux = ["lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1",
            "lora_te1_text_model_encoder_layers_0_mlp_fc1"]
    for length in (12, 17, 20, 26):
        with pytest.raises(ConfigError, match=r"^--lbws: \d+ values are for SD(XL| 1.x/2.x) LoRAs, but the UNet "
                                              r"modules of flux.safetensors \(e.g. lora_unet_double_blocks_0_img_attn_"
                                              r"qkv\) are not in its blocks; .*FLUX.1 has no block-weight standard\)$"):
            module_block_weights([1.0] * length, flux, "flux.safetensors")
