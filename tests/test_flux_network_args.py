"""FLUX.1 network args of networks.lora (sd-scripts' lora_flux.py): per-type dims, in_dims, block selection,
regex dims / learning rates, T5 training; names and shapes on tiny, counts on the full size (meta device)."""

import json
import logging

import pytest
import torch

from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import Components
from library.families.flux.configs import (
    PRESETS,
    build_flux_modules,
    transformer_config,
)
from networks.lora import create_network, create_network_from_weights
from tests.train_helpers import base_args, make_dataset, make_trainer

DOUBLE = ["img_mod_lin", "txt_mod_lin", "img_attn_qkv", "img_attn_proj", "txt_attn_qkv", "txt_attn_proj",
          "img_mlp_0", "img_mlp_2", "txt_mlp_0", "txt_mlp_2"]
SINGLE = ["modulation_lin", "linear1", "linear2"]
# Each per-type dim and the layers (of every block of its kind) it sets.
TYPE_LAYERS = {
    "img_attn_dim": ["img_attn_qkv", "img_attn_proj"], "img_mlp_dim": ["img_mlp_0", "img_mlp_2"],
    "img_mod_dim": ["img_mod_lin"], "txt_attn_dim": ["txt_attn_qkv", "txt_attn_proj"],
    "txt_mlp_dim": ["txt_mlp_0", "txt_mlp_2"], "txt_mod_dim": ["txt_mod_lin"],
    "single_dim": ["linear1", "linear2"], "single_mod_dim": ["modulation_lin"],
}


@pytest.fixture
def tiny(tiny_flux):
    return get_family("flux"), tiny_flux


@pytest.fixture(scope="module")
def full_dev():
    parts = build_flux_modules("random:flux-dev", device="meta")
    return Components(parts["transformer"], parts["vae"], [parts["text_encoder"], parts["text_encoder_2"]],
                      [parts["tokenizer"], parts["tokenizer_2"]])


def _net(family, components, dim=4, alpha=2.0, **args):
    return create_network(1.0, dim, alpha, None, components.text_encoders, components.denoiser,
                          lora_targets=family.lora_targets(components), **args)


def _unet_dims(net) -> dict[str, int]:
    return {lora.lora_name[len("lora_unet_"):]: lora.lora_dim for lora in net.unet_loras}


def _block_names(kind: str, indices, layers) -> list[str]:
    return [f"{kind}_blocks_{i}_{layer}" for i in indices for layer in layers]


def test_train_blocks_single_or_double(tiny):
    family, c = tiny
    assert list(_unet_dims(_net(family, c, train_blocks="single"))) == _block_names("single", range(3), SINGLE)
    assert list(_unet_dims(_net(family, c, train_blocks="double"))) == _block_names("double", range(2), DOUBLE)
    assert len(_net(family, c, train_blocks="all").unet_loras) == 2 * 10 + 3 * 3


def test_block_indices_on_the_full_size(full_dev):
    family = get_family("flux")
    net = _net(family, full_dev, train_double_block_indices="0,2-3", train_single_block_indices="none")
    assert list(_unet_dims(net)) == _block_names("double", [0, 2, 3], DOUBLE)
    net = _net(family, full_dev, train_double_block_indices="none", train_single_block_indices="36-37,5")
    assert list(_unet_dims(net)) == _block_names("single", [5, 36, 37], SINGLE)
    # "all" is every block; train_blocks drops a kind whatever its indices say
    assert len(_net(family, full_dev, train_double_block_indices="all").unet_loras) == 304
    assert len(_net(family, full_dev, train_blocks="single", train_double_block_indices="0").unet_loras) == 38 * 3


@pytest.mark.parametrize("arg", list(TYPE_LAYERS))
def test_each_per_type_dim_sets_its_layers(tiny, arg):
    family, c = tiny
    sd = _net(family, c, **{arg: "2"}).state_dict()
    for name in _block_names("double", range(2), DOUBLE) + _block_names("single", range(3), SINGLE):
        rank = 2 if name.split("_blocks_")[1].split("_", 1)[1] in TYPE_LAYERS[arg] else 4
        down, up = sd[f"lora_unet_{name}.lora_down.weight"], sd[f"lora_unet_{name}.lora_up.weight"]
        assert down.shape[0] == rank and up.shape[1] == rank, name
        assert float(sd[f"lora_unet_{name}.alpha"]) == 2.0  # alpha stays network_alpha
    # 0 drops that type
    dims = _unet_dims(_net(family, c, **{arg: "0"}))
    kept = [n for n in _block_names("double", range(2), DOUBLE) + _block_names("single", range(3), SINGLE)
            if n.split("_blocks_")[1].split("_", 1)[1] not in TYPE_LAYERS[arg]]
    assert list(dims) == kept


def test_per_type_dims_shapes_of_fused_layers(tiny):
    family, c = tiny
    sd = _net(family, c, img_attn_dim="8", single_dim="3", txt_mod_dim="0").state_dict()
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape == (8, 32)
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape == (96, 8)
    assert sd["lora_unet_single_blocks_2_linear1.lora_up.weight"].shape == (224, 3)
    assert sd["lora_unet_single_blocks_2_linear2.lora_down.weight"].shape == (3, 160)
    assert sd["lora_unet_double_blocks_0_txt_attn_qkv.lora_up.weight"].shape == (96, 4)
    assert not any(k.startswith("lora_unet_double_blocks_0_txt_mod_lin") for k in sd)


def test_in_dims_names_and_shapes(tiny):
    family, c = tiny
    net = _net(family, c, in_dims="[2,3,0,5,6]")
    sd = net.state_dict()
    shapes = {lora.lora_name: (tuple(sd[lora.lora_name + ".lora_down.weight"].shape),
                               tuple(sd[lora.lora_name + ".lora_up.weight"].shape))
              for lora in net.unet_loras[29:]}
    assert shapes == {  # vector_in (3rd value) is 0: no module
        "lora_unet_img_in": ((2, 64), (32, 2)),
        "lora_unet_txt_in": ((6, 32), (32, 6)),
        "lora_unet_time_in_in_layer": ((3, 256), (32, 3)),
        "lora_unet_time_in_out_layer": ((3, 32), (32, 3)),
        "lora_unet_guidance_in_in_layer": ((5, 256), (32, 5)),
        "lora_unet_guidance_in_out_layer": ((5, 32), (32, 5)),
    }
    assert len(_net(family, c, in_dims="0,0,0,0,0").unet_loras) == 29


def test_in_dims_counts_on_the_full_size(full_dev):
    family = get_family("flux")
    dev = _net(family, full_dev, in_dims="4,4,4,4,4")
    assert len(dev.unet_loras) == 304 + 8
    assert dev.unet_loras[-1].lora_up.weight.shape == (3072, 4)
    with torch.device("meta"):
        from diffusers import FluxTransformer2DModel

        schnell = FluxTransformer2DModel(**transformer_config(PRESETS["random:flux-schnell"]))
    c = Components(schnell, None, [None], [None])
    names = [lora.lora_name for lora in _net(family, c, in_dims="4,4,4,4,4").unet_loras[304:]]
    assert names == ["lora_unet_img_in", "lora_unet_txt_in", "lora_unet_time_in_in_layer",
                     "lora_unet_time_in_out_layer", "lora_unet_vector_in_in_layer", "lora_unet_vector_in_out_layer"]


def test_network_reg_dims_first_match_wins(tiny):
    family, c = tiny
    dims = _unet_dims(_net(family, c, network_reg_dims="single_blocks_1=7,single=9"))
    assert [dims[f"single_blocks_{i}_linear1"] for i in range(3)] == [9, 7, 9]
    # the other order: the broader pattern matches first everywhere
    dims = _unet_dims(_net(family, c, network_reg_dims="single=9,single_blocks_1=7"))
    assert [dims[f"single_blocks_{i}_linear1"] for i in range(3)] == [9, 9, 9]
    assert dims["double_blocks_0_img_attn_qkv"] == 4
    # a match beats the per-type dim and the block indices (as sd-scripts), not train_blocks; text encoders too
    net = _net(family, c, network_reg_dims="double_blocks_1_img_attn=6,te1_.*layers_0_.*q_proj=5", img_attn_dim="2",
               train_double_block_indices="0")
    dims = _unet_dims(net)
    assert (dims["double_blocks_0_img_attn_qkv"], dims["double_blocks_1_img_attn_qkv"]) == (2, 6)
    assert [n for n in dims if n.startswith("double_blocks_1")] == ["double_blocks_1_img_attn_qkv",
                                                                    "double_blocks_1_img_attn_proj"]
    te = {lora.lora_name: lora.lora_dim for lora in net.text_encoder_loras}
    assert te["lora_te1_text_model_encoder_layers_0_self_attn_q_proj"] == 5
    assert te["lora_te1_text_model_encoder_layers_1_self_attn_q_proj"] == 4
    assert "double_blocks_1_img_attn_qkv" not in _unet_dims(
        _net(family, c, network_reg_dims="img_attn=6", train_blocks="single"))


def test_network_reg_lrs_param_groups(tiny):
    family, c = tiny
    net = _net(family, c, network_reg_lrs="img_attn=1e-4,double_blocks_0=5e-5,te1_.*layers_1_=0")
    groups, names = net.prepare_optimizer_params(2e-4, 1e-3, 1e-2)
    assert names == ["textencoder", "unet reg_lr_0", "unet reg_lr_1", "unet"]
    assert [g["lr"] for g in groups] == [2e-4, 1e-4, 5e-5, 1e-3]
    # img_attn qkv + proj of 2 blocks; the other 8 layers of block 0; the rest. CLIP layer 1 (lr 0) is left out.
    assert [len(g["params"]) for g in groups] == [2 * (72 - 6), 2 * 4, 2 * 8, 2 * (29 - 12)]
    # with LoRA+ every group gets its "plus" twin at lr x ratio
    net = _net(family, c, network_reg_lrs="img_attn=1e-4", loraplus_unet_lr_ratio="4")
    groups, names = net.prepare_optimizer_params(None, 1e-3, 1e-3)
    assert names == ["textencoder", "unet reg_lr_0", "unet reg_lr_0 plus", "unet", "unet plus"]
    assert [g["lr"] for g in groups] == [1e-3, 1e-4, 4e-4, 1e-3, 4e-3]


def test_train_t5xxl_names_and_per_encoder_lrs(tiny):
    family, c = tiny
    assert len(_net(family, c).text_encoder_loras) == 72  # T5 is off by default
    net = _net(family, c, train_t5xxl="True")
    te3 = [lora.lora_name for lora in net.text_encoder_loras if lora.lora_name.startswith("lora_te3_")]
    assert len(te3) == 168 and len(net.text_encoder_loras) == 72 + 168
    assert te3[:7] == [f"lora_te3_encoder_block_0_layer_0_SelfAttention_{p}" for p in "qkvo"] + \
        [f"lora_te3_encoder_block_0_layer_1_DenseReluDense_{p}" for p in ("wi_0", "wi_1", "wo")]
    groups, names = net.prepare_optimizer_params([1e-4, 2e-5], 1e-3, 1e-3)
    assert names == ["textencoder 1", "textencoder 2", "unet"]
    assert [(g["lr"], len(g["params"])) for g in groups] == [(1e-4, 144), (2e-5, 336), (1e-3, 58)]
    groups, names = net.prepare_optimizer_params([3e-5], 1e-3, 1e-3)  # one rate: both encoders
    assert names == ["textencoder", "unet"] and groups[0]["lr"] == 3e-5 and len(groups[0]["params"]) == 480


def test_train_t5xxl_count_on_the_full_size(full_dev):
    family = get_family("flux")
    net = _net(family, full_dev, train_t5xxl="true", in_dims="0,0,0,0,0")
    te = [lora.lora_name for lora in net.text_encoder_loras]
    assert (sum(n.startswith("lora_te1_") for n in te), sum(n.startswith("lora_te3_") for n in te)) == (72, 168)
    assert "lora_te3_encoder_block_23_layer_1_DenseReluDense_wi_0" in te and len(net.unet_loras) == 304


def test_t5_without_training_text_encoders_warns(tiny, caplog):
    family, c = tiny
    net = _net(family, c, train_t5xxl="True")
    with caplog.at_level(logging.WARNING):
        net.apply_to(c.text_encoders, c.denoiser, apply_text_encoder=False, apply_unet=True)
    net.restore()
    assert "--network_args train_t5xxl: the text encoders do not train in this run" in caplog.text
    assert net.text_encoder_loras == []


@pytest.mark.parametrize("args, message", [
    ({"img_attn_dim": "four"}, "--network_args img_attn_dim: expected an integer >= 0 (0: no module), got 'four'"),
    ({"single_mod_dim": "-1"}, "--network_args single_mod_dim: expected an integer >= 0"),
    ({"in_dims": "4,4,4"}, "--network_args in_dims: expected 5 comma-separated integers >= 0 "
                           "[img,time,vector,guidance,txt], got 3 values"),
    ({"train_blocks": "both"}, "--network_args train_blocks: expected one of all, single, double, got 'both'"),
    ({"train_double_block_indices": "0,2-5"},
     "--network_args train_double_block_indices: expected indices from 0 to 1 like 0,3-5, or all, or none "
     "(this model has 2 blocks), got '2-5'"),
    ({"train_single_block_indices": "x"}, "--network_args train_single_block_indices: expected indices"),
    ({"network_reg_dims": "attn"}, "--network_args network_reg_dims: expected regex=an integer >= 0"),
    ({"network_reg_dims": "attn(=4"}, "--network_args network_reg_dims: 'attn(' is not a regular expression"),
    ({"network_reg_lrs": "attn=fast"}, "--network_args network_reg_lrs: expected a number >= 0, got 'fast'"),
    ({"train_t5xxl": "maybe"}, "--network_args train_t5xxl: expected True or False, got 'maybe'"),
    ({"split_qkv": "maybe"}, "--network_args split_qkv: expected True or False, got 'maybe'"),
    ({"ggpo_sigma": "0.03"}, "--network_args ggpo_sigma: LoRA-GGPO needs ggpo_beta too"),
    ({"ggpo_beta": "0.01"}, "--network_args ggpo_beta: LoRA-GGPO needs ggpo_sigma too"),
    ({"ggpo_sigma": "x", "ggpo_beta": "0.01"}, "--network_args ggpo_sigma: expected a finite number >= 0, got 'x'"),
    ({"ggpo_sigma": "0.03", "ggpo_beta": "-1"}, "--network_args ggpo_beta: expected a finite number >= 0, got '-1'"),
    ({"ggpo_sigma": "nan", "ggpo_beta": "0.01"}, "--network_args ggpo_sigma: expected a finite number >= 0, got 'nan'"),
    ({"img_atn_dim": "4"}, "--network_args img_atn_dim: unknown argument for networks.lora with this model"),
])
def test_bad_values_are_one_line_errors(tiny, args, message):
    family, c = tiny
    with pytest.raises(ConfigError) as e:
        _net(family, c, **args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_flux_args_are_refused_for_other_models():
    with pytest.raises(ConfigError, match="^--network_args img_attn_dim: unknown argument for networks.lora"):
        create_network(1.0, 4, 1.0, None, None, None, lora_targets=[], img_attn_dim="4")
    # split_qkv=False is sd-scripts' default and changes nothing
    assert create_network(1.0, 4, 1.0, None, None, None, lora_targets=[]).unet_loras == []


def test_tiny_run_with_flux_args_trains_t5_and_reloads(tmp_path, tiny_flux):
    from safetensors import safe_open

    data = make_dataset(str(tmp_path), n=2)
    args = ["train_t5xxl=True", "in_dims=[2,0,0,0,3]", "img_attn_dim=8", "train_single_block_indices=0",
            "network_reg_lrs=txt_in=5e-3"]
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:flux", steps=2, extra=[
        "--t5xxl_max_token_length", "16", "--text_encoder_lr", "1e-3", "5e-4", "--network_args", *args]), "flux")
    path = trainer.run()
    with safe_open(path, "pt") as f:
        names = sorted({k.split(".")[0] for k in f.keys()})
        metadata = f.metadata()
        t5_up = f.get_tensor("lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight")
        qkv_down = f.get_tensor("lora_unet_double_blocks_1_img_attn_qkv.lora_down.weight")
        txt_in_up = f.get_tensor("lora_unet_txt_in.lora_up.weight")
    unet = [n for n in names if n.startswith("lora_unet_")]
    assert unet == sorted(["lora_unet_img_in", "lora_unet_txt_in"] + [
        f"lora_unet_{n}" for n in _block_names("double", range(2), DOUBLE) + _block_names("single", [0], SINGLE)])
    assert (sum(n.startswith("lora_te1_") for n in names), sum(n.startswith("lora_te3_") for n in names)) == (72, 168)
    assert t5_up.abs().sum() > 0 and txt_in_up.abs().sum() > 0  # T5 and txt_in trained
    assert qkv_down.shape == (8, 32) and txt_in_up.shape == (32, 3)
    assert json.loads(metadata["ss_network_args"]) == dict(a.split("=", 1) for a in args)

    # --dim_from_weights rebuilds the same modules from the file alone, no network args needed
    family = get_family("flux")
    c = tiny_flux
    net, sd = create_network_from_weights(1.0, path, None, c.text_encoders, c.denoiser,
                                          lora_targets=family.lora_targets(c))
    assert sorted(lora.lora_name for lora in net.text_encoder_loras + net.unet_loras) == names
    assert net.load_weights(path).unexpected_keys == []
    assert torch.equal(net.state_dict()["lora_unet_txt_in.lora_up.weight"], txt_in_up)
