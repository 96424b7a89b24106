"""networks/lora.py, lora_math.py and lora_args.py: modules, keys, dims, LR groups, norms, save/load."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from library.core.errors import ConfigError, UserError
from networks import lora, lora_math
from networks.lora_args import (
    SD_BLOCK_LAYOUT,
    BlockLayout,
    parse_network_args,
    sd_unet_block_index,
)
from networks.lora_targets import LoraTarget


# --- a hand-built model: one attention-like block and one conv block ------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(8, 6)
        self.proj = nn.Conv2d(6, 5, 1)


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(5, 7, 3, stride=2, padding=1)
        self.shortcut = nn.Conv2d(5, 7, 1)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Block()
        self.res = ConvBlock()
        self.head = nn.Linear(3, 3)  # in no target class: never gets a LoRA


def toy_targets(model):
    return [LoraTarget("lora_unet", model, ("Block",), ("ConvBlock",))]


def randomize_up(network, std=0.1, seed=1):
    g = torch.Generator().manual_seed(seed)
    for m in network.text_encoder_loras + network.unet_loras:
        m.lora_up.weight.data = torch.randn(m.lora_up.weight.shape, generator=g) * std


# --- lora_math ---------------------------------------------------------------------
def test_delta_weight_linear_1x1_and_kxk_match_the_module_math():
    torch.manual_seed(0)
    down, up = torch.randn(3, 8), torch.randn(6, 3)
    assert torch.allclose(lora_math.delta_weight(down, up, 1.5), up @ down * 0.5)
    dw = lora_math.delta_weight(down[:, :, None, None], up[:, :, None, None], None)  # alpha None: scale 1
    assert dw.shape == (6, 8, 1, 1) and torch.allclose(dw[:, :, 0, 0], up @ down)
    down_k, up_k = torch.randn(3, 5, 3, 3), torch.randn(7, 3, 1, 1)
    dw = lora_math.delta_weight(down_k, up_k, 6)  # scale 2
    assert dw.shape == (7, 5, 3, 3)
    x = torch.randn(2, 5, 9, 9)
    two_step = F.conv2d(F.conv2d(x, down_k, stride=2, padding=1), up_k) * 2
    assert torch.allclose(F.conv2d(x, dw, stride=2, padding=1), two_step, atol=1e-4)
    assert lora_math.lora_scale(0, 8) == 1.0 and lora_math.lora_scale(torch.tensor(2.0), 8) == 0.25


def test_merge_into_and_max_norm_rule():
    w = torch.zeros(2, 2, dtype=torch.float16)
    merged = lora_math.merge_into(w, torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0], [0.0]]), 1, ratio=0.5)
    assert merged.dtype == torch.float16 and merged.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    down, up = torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0]])  # ‖ΔW‖ = 5 at alpha = dim = 1
    r = lora_math.frobenius_scale_for_max_norm(down, up, 1, 2.0)
    assert (r.ratio, r.norm, r.scaled) == (pytest.approx(0.4), pytest.approx(2.0), True)
    assert r.factor == pytest.approx(math.sqrt(0.4))
    small = lora_math.frobenius_scale_for_max_norm(down, up, 1, 20.0)  # below the limit: untouched
    assert (small.ratio, small.norm, small.scaled) == (1.0, pytest.approx(5.0), False)


# --- LoRAModule ----------------------------------------------------------------------
def test_module_shapes_keys_and_alpha():
    lin = lora.LoRAModule("l", nn.Linear(8, 6), lora_dim=3, alpha=1.5)
    assert sorted(lin.state_dict()) == ["alpha", "lora_down.weight", "lora_up.weight"]
    assert lin.lora_down.weight.shape == (3, 8) and lin.lora_up.weight.shape == (6, 3)
    assert lin.alpha.dim() == 0 and lin.alpha.item() == 1.5 and lin.scale == 0.5
    assert torch.count_nonzero(lin.lora_up.weight) == 0
    conv = lora.LoRAModule("c", nn.Conv2d(5, 7, 3, stride=2, padding=1, dilation=1), lora_dim=2, alpha=0)
    assert conv.lora_down.weight.shape == (2, 5, 3, 3) and conv.lora_up.weight.shape == (7, 2, 1, 1)
    assert conv.lora_down.stride == (2, 2) and conv.lora_down.padding == (1, 1) and conv.lora_up.kernel_size == (1, 1)
    assert conv.alpha.item() == 2.0 and conv.scale == 1.0  # alpha 0 means alpha = dim


@pytest.mark.parametrize("org", [nn.Linear(8, 6), nn.Conv2d(5, 7, 1), nn.Conv2d(5, 7, 3, stride=2, padding=1)])
def test_forward_is_base_at_init_then_base_plus_delta_weight(org):
    torch.manual_seed(0)
    x = torch.randn(2, 8) if isinstance(org, nn.Linear) else torch.randn(2, 5, 9, 9)
    base = org(x)
    m = lora.LoRAModule("m", org, multiplier=1.0, lora_dim=3, alpha=1.5)
    m.apply_to()
    assert torch.equal(org(x), base)
    nn.init.normal_(m.lora_up.weight)
    ref = type(org)(*([8, 6] if isinstance(org, nn.Linear) else [5, 7, org.kernel_size, org.stride, org.padding]))
    ref.load_state_dict(org.state_dict())
    ref.weight.data = lora_math.merge_into(ref.weight.data, m.lora_down.weight, m.lora_up.weight, m.alpha, 1.0)
    assert torch.allclose(org(x), ref(x), atol=1e-5)
    m.multiplier = 0.5  # the update is linear in the multiplier
    assert torch.allclose(org(x) - base, (ref(x) - base) * 0.5, atol=1e-5)
    m.restore()
    assert "forward" not in org.__dict__ and torch.equal(org(x), base)
    assert sorted(org.state_dict()) == ["bias", "weight"]


def test_module_works_in_half_precision_base():
    org = nn.Linear(8, 6).to(torch.bfloat16)
    m = lora.LoRAModule("m", org, lora_dim=2, alpha=2)
    m.apply_to()
    nn.init.ones_(m.lora_up.weight)
    out = org(torch.ones(1, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and m.lora_down.weight.dtype == torch.float32


def test_dropouts_only_in_training():
    torch.manual_seed(0)
    org = nn.Linear(8, 6)
    x = torch.randn(4, 5, 8)  # (batch, tokens, features), as in a text encoder
    m = lora.LoRAModule("m", org, lora_dim=4, alpha=4, dropout=0.5, rank_dropout=0.5, module_dropout=0.5)
    m.apply_to()
    nn.init.normal_(m.lora_up.weight)
    m.eval()
    expected = F.linear(x, org.weight, org.bias) + m.lora_up(m.lora_down(x))
    assert torch.allclose(org(x), expected, atol=1e-5)
    m.train()
    outs = {tuple(org(x).flatten()[:4].tolist()) for _ in range(10)}
    assert len(outs) > 1  # random in training
    # rank dropout alone: a per-sample mask over the rank, and the scale grows by 1/(1-p)
    r = lora.LoRAModule("r", nn.Linear(8, 6), lora_dim=4, alpha=4, rank_dropout=0.25)
    r.apply_to()
    nn.init.normal_(r.lora_up.weight)
    r.train()
    torch.manual_seed(3)
    got = r.org_module(x)
    torch.manual_seed(3)
    mask = (torch.rand(4, 4) > 0.25).float().unsqueeze(1)
    want = F.linear(x, r.org_module.weight, r.org_module.bias) + r.lora_up(r.lora_down(x) * mask) / 0.75
    assert torch.allclose(got, want, atol=1e-5)


# --- network on the hand-built model ------------------------------------------------------
def test_toy_network_names_dims_and_conv():
    model = Toy()
    net = lora.create_network(1.0, 4, 1, None, None, model, lora_targets=toy_targets(model))
    assert [m.lora_name for m in net.unet_loras] == ["lora_unet_attn_to_q", "lora_unet_attn_proj"]
    net = lora.create_network(1.0, 4, 1, None, None, model, lora_targets=toy_targets(model), conv_dim="2",
                              conv_alpha="1")
    dims = {m.lora_name: (m.lora_dim, m.alpha.item()) for m in net.unet_loras}
    # the 1x1 shortcut of a conv block takes the linear dim, the 3x3 conv the conv dim
    assert dims == {"lora_unet_attn_to_q": (4, 1.0), "lora_unet_attn_proj": (4, 1.0),
                    "lora_unet_res_conv": (2, 1.0), "lora_unet_res_shortcut": (4, 1.0)}
    assert sorted(net.state_dict())[:3] == ["lora_unet_attn_proj.alpha", "lora_unet_attn_proj.lora_down.weight",
                                            "lora_unet_attn_proj.lora_up.weight"]


@pytest.mark.parametrize("kwargs, message", [
    ({"conv_dim": "x"}, "--network_args conv_dim: expected an integer, got 'x'"),
    ({"rank_dropout": "1.5"}, "--network_args rank_dropout: expected a number in [0, 1), got 1.5"),
    ({"conv_dims": "4"}, "--network_args conv_dims: unknown argument for networks.lora"),
    ({"block_dims": "1,2"}, "--network_args block_dims: expected 25 comma-separated integers"),
    ({"down_lr_weight": "cosin"}, "--network_args down_lr_weight: expected up to 12 comma-separated numbers"),
])
def test_bad_network_args_name_the_argument(kwargs, message):
    with pytest.raises(ConfigError) as e:
        parse_network_args(kwargs)
    assert str(e.value).startswith(message)


def test_lr_weight_presets_and_padding():
    a = parse_network_args({"down_lr_weight": "linear+0.5", "up_lr_weight": "0,,0.5", "mid_lr_weight": "2"})
    assert a.down_lr_weight == pytest.approx([0.5 + i / 11 for i in range(12)])
    assert a.up_lr_weight == [0.0, 0.0, 0.5] + [1.0] * 9
    assert a.mid_lr_weight == [2.0]
    assert a.block_lr_weights == pytest.approx(a.down_lr_weight + [2.0] + a.up_lr_weight)  # SD: IN00 is block 0
    cos = parse_network_args({"down_lr_weight": "cosine"}).down_lr_weight
    assert cos[0] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.0) and cos[6] == pytest.approx(math.sin(math.pi * 5 / 22))
    z = parse_network_args({"up_lr_weight": "0.1,0.3", "block_lr_zero_threshold": "0.2"})
    assert z.up_lr_weight[:3] == [0.0, 0.3, 1.0]
    assert z.block_dims[13] == 0 and z.block_dims[14] == 4  # OUT00 (weight 0) gets no modules


def test_sd_block_index_map():
    cases = {
        "lora_unet_down_blocks_0_attentions_0_proj_in": 1,
        "lora_unet_down_blocks_0_resnets_1_conv1": 2,
        "lora_unet_down_blocks_0_downsamplers_0_conv": 3,
        "lora_unet_down_blocks_3_resnets_1_conv2": 11,
        "lora_unet_mid_block_attentions_0_proj_out": 12,
        "lora_unet_up_blocks_0_resnets_0_conv1": 13,
        "lora_unet_up_blocks_0_upsamplers_0_conv": 15,
        "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_ff_net_2": 24,
        "lora_te_text_model_encoder_layers_0_mlp_fc1": -1,
    }
    assert {k: sd_unet_block_index(k) for k in cases} == cases


def test_scale_weight_norms_on_network():
    model = Toy()
    net = lora.create_network(1.0, 1, 1, None, None, model, lora_targets=toy_targets(model))
    q, p = net.unet_loras
    q.lora_down.weight.data = torch.zeros(1, 8)
    q.lora_down.weight.data[0, :2] = torch.tensor([3.0, 4.0])
    q.lora_up.weight.data = torch.zeros(6, 1)
    q.lora_up.weight.data[0, 0] = 1.0  # ‖ΔW‖ = 5
    p.lora_up.weight.data.zero_()  # ‖ΔW‖ = 0
    scaled, mean, biggest = net.apply_max_norm_regularization(2.0, "cpu")
    assert (scaled, mean, biggest) == (1, pytest.approx(1.0), pytest.approx(2.0))
    assert float(q.delta_weight().detach().norm()) == pytest.approx(2.0)
    assert q.lora_down.weight[0, 0].item() == pytest.approx(3 * math.sqrt(0.4))


# --- tiny SD1 / SD2 -----------------------------------------------------------------------
@pytest.fixture
def sd1(tiny_sd1_modules):
    return tiny_sd1_modules


@pytest.fixture(scope="module")
def full_meta():
    from library.families.sd.configs import build_sd_modules

    return build_sd_modules("random:sd15", device="meta")


def test_tiny_sd1_key_names_and_counts(sd1):
    net = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"])
    assert (len(net.unet_loras), len(net.text_encoder_loras), len(net.state_dict())) == (192, 72, 792)
    names = {m.lora_name for m in net.unet_loras + net.text_encoder_loras}
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q" in names
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_ff_net_0_proj" in names
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in names
    assert "lora_te_text_model_encoder_layers_11_mlp_fc2" in names
    sd = net.state_dict()
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"].shape == (4, 32, 1, 1)  # SD1: conv
    assert sd["lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha"].shape == ()
    assert sd["lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha"].dtype == torch.float32


def test_family_targets_give_the_same_network(sd1):
    from library.families import get_family
    from library.families.base import Components

    family = get_family("sd")
    comps = Components(denoiser=sd1["unet"], vae=sd1["vae"], text_encoders=[sd1["text_encoder"]],
                       tokenizers=[sd1["tokenizer"]])
    net = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"], conv_dim="4",
                              lora_targets=family.lora_targets(comps))
    default = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"], conv_dim="4")
    assert (len(net.unet_loras), len(net.text_encoder_loras)) == (278, 72)
    assert sorted(net.state_dict()) == sorted(default.state_dict())


def test_full_size_sd15_counts_on_meta(full_meta):
    net = lora.create_network(1.0, 4, 1, None, full_meta["text_encoder"], full_meta["unet"])
    assert (len(net.unet_loras), len(net.text_encoder_loras)) == (192, 72)
    conv = lora.create_network(1.0, 4, 1, None, full_meta["text_encoder"], full_meta["unet"], conv_dim="4")
    assert len(conv.unet_loras) == 278
    sd = conv.state_dict()
    assert sd["lora_unet_down_blocks_1_resnets_0_conv_shortcut.lora_down.weight"].shape == (4, 320, 1, 1)
    assert sd["lora_unet_up_blocks_0_upsamplers_0_conv.lora_down.weight"].shape == (4, 1280, 3, 3)
    assert sd["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"].shape == (3072, 4)


def test_tiny_conv_names_equal_full_size_names(sd1, full_meta):
    tiny = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"], conv_dim="4")
    full = lora.create_network(1.0, 4, 1, None, full_meta["text_encoder"], full_meta["unet"], conv_dim="4")
    assert sorted(tiny.state_dict()) == sorted(full.state_dict())


def test_tiny_sd2_proj_in_is_linear(tiny_sd2_modules):
    m = tiny_sd2_modules
    net = lora.create_network(1.0, 4, 1, None, m["text_encoder"], m["unet"])
    sd = net.state_dict()
    assert (len(net.unet_loras), len(net.text_encoder_loras)) == (192, 138)  # 23 text layers x 6
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"].shape == (4, 32)
    assert sd["lora_unet_up_blocks_3_attentions_2_proj_out.lora_up.weight"].shape == (32, 4)


def test_block_dims_golden(sd1):
    dims = ",".join(str(i) for i in range(25))  # block i gets dim i (block 0 has no modules)
    net = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"], block_dims=dims,
                              conv_block_dims=",".join(["2"] * 25), conv_block_alphas=",".join(["0.5"] * 25))
    got = {m.lora_name: m.lora_dim for m in net.unet_loras}
    assert got["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"] == 1
    assert got["lora_unet_down_blocks_0_attentions_1_proj_out"] == 2
    assert got["lora_unet_down_blocks_0_downsamplers_0_conv"] == 2
    assert got["lora_unet_down_blocks_2_resnets_0_conv_shortcut"] == 7  # 1x1: the linear block dim
    assert got["lora_unet_down_blocks_2_resnets_0_conv1"] == 2  # kxk: the conv block dim
    assert got["lora_unet_mid_block_attentions_0_proj_in"] == 12
    assert got["lora_unet_up_blocks_1_attentions_0_proj_in"] == 16
    assert got["lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_attn2_to_out_0"] == 24
    assert net.unet_loras[0].alpha.item() == 1.0
    assert {m.lora_dim for m in net.text_encoder_loras} == {4}  # block dims are for the UNet only


def test_lr_groups_plain_block_and_loraplus(sd1):
    net = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"])
    groups, names = net.prepare_optimizer_params([5e-5, 1e-5], None, 1e-4)
    assert names == ["textencoder", "unet"] and [g["lr"] for g in groups] == [5e-5, 1e-4]
    assert [len(g["params"]) for g in groups] == [144, 384]
    groups, names = net.prepare_optimizer_params(0, 1e-4, 1e-3)  # lr 0: the group is dropped
    assert names == ["unet"]

    plus = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"], loraplus_lr_ratio="16",
                               loraplus_text_encoder_lr_ratio="4")
    groups, names = plus.prepare_optimizer_params(None, 1e-4, 1e-5)
    assert names == ["textencoder", "textencoder plus", "unet", "unet plus"]
    assert [g["lr"] for g in groups] == pytest.approx([1e-5, 4e-5, 1e-4, 1.6e-3])
    assert [len(g["params"]) for g in groups] == [72, 72, 192, 192]

    blocks = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"],
                                 down_lr_weight="0,0,0,0,0,0,1,1,1,1,1,1", mid_lr_weight="0.5", up_lr_weight="zeros+0.25")
    groups, names = blocks.prepare_optimizer_params(None, 1.0, 1.0)
    # blocks 1-5 have weight 0: their modules are not created at all; without conv only
    # blocks holding attentions have modules (OUT00-02 is a plain UpBlock2D)
    assert names == ["textencoder", "unet block 7", "unet block 8", "unet block 12"] + [
        f"unet block {i}" for i in range(16, 25)]
    lrs = dict(zip(names, (g["lr"] for g in groups)))
    assert lrs["unet block 7"] == 1.0 and lrs["unet block 12"] == 0.5 and lrs["unet block 24"] == 0.25
    assert not any(m.lora_name.startswith("lora_unet_down_blocks_0_") for m in blocks.unet_loras)


def test_apply_to_without_text_encoder_drops_its_keys(sd1):
    net = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"])
    net.apply_to(sd1["text_encoder"], sd1["unet"], apply_text_encoder=False, apply_unet=True)
    try:
        assert net.text_encoder_loras == [] and len(net.state_dict()) == 576
        assert all(k.startswith("lora_unet_") for k in net.state_dict())
    finally:
        net.restore()


def test_save_load_roundtrip_and_dims_from_weights(sd1, tmp_path):
    net = lora.create_network(1.0, 4, 2, None, sd1["text_encoder"], sd1["unet"], conv_dim="2", conv_alpha="0.5")
    randomize_up(net)
    path = str(tmp_path / "x.safetensors")
    net.save_weights(path, torch.float16, {"ss_network_dim": "4"})
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        meta = f.metadata()
        alpha = f.get_tensor("lora_unet_down_blocks_0_resnets_0_conv1.alpha")
    assert set(meta) == {"ss_network_dim", "sshs_model_hash", "sshs_legacy_hash"}
    assert alpha.dtype == torch.float16 and alpha.shape == () and alpha.item() == 0.5
    assert not any(name.startswith(".x.safetensors") for name in os.listdir(tmp_path))  # no temp file left

    loaded, sd = lora.create_network_from_weights(1.0, path, None, sd1["text_encoder"], sd1["unet"])
    assert {m.lora_name: m.lora_dim for m in loaded.unet_loras} == {m.lora_name: m.lora_dim for m in net.unet_loras}
    assert len(loaded.unet_loras) == len(net.unet_loras)
    assert loaded.unet_loras[0].scale == 0.5
    conv = next(m for m in loaded.unet_loras if m.lora_name == "lora_unet_down_blocks_0_resnets_0_conv1")
    assert (conv.lora_dim, conv.scale) == (2, 0.25)
    info = loaded.load_weights(path)
    assert info.missing_keys == [] and info.unexpected_keys == []
    for key, value in loaded.state_dict().items():
        assert torch.equal(value.to(torch.float16), sd[key]), key

    other = lora.create_network(1.0, 8, 1, None, sd1["text_encoder"], sd1["unet"])
    with pytest.raises(UserError, match="has shape .* in the file but .* in the network"):
        other.load_weights(path)


def test_merge_to_equals_applied_network(sd1):
    import copy

    fresh = {k: copy.deepcopy(sd1[k]) for k in ("text_encoder", "unet")}
    net = lora.create_network(0.7, 4, 2, None, sd1["text_encoder"], sd1["unet"], conv_dim="2")
    randomize_up(net, std=0.2)
    ids = torch.tensor([[49406, 320, 1125, 49407] + [49407] * 3])
    ids = ids.clamp(max=sd1["text_encoder"].config.vocab_size - 1)
    net.apply_to(sd1["text_encoder"], sd1["unet"])
    try:
        with torch.no_grad():
            te_lora = sd1["text_encoder"](ids).last_hidden_state
            x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
            unet_lora = sd1["unet"](x, 10, te_lora).sample
    finally:
        net.restore()
    weights = net.state_dict()
    merger, _ = lora.create_network_from_weights(0.7, None, None, fresh["text_encoder"], fresh["unet"], weights_sd=weights)
    merger.merge_to(fresh["text_encoder"], fresh["unet"], weights, torch.float32, "cpu")
    with torch.no_grad():
        te_merged = fresh["text_encoder"](ids).last_hidden_state
        unet_merged = fresh["unet"](x, 10, te_merged).sample
    assert torch.allclose(te_merged, te_lora, atol=1e-4, rtol=1e-4)
    assert torch.allclose(unet_merged, unet_lora, atol=1e-4, rtol=1e-4)


def test_load_weights_from_a_state_dict(sd1):
    net = lora.create_network(1.0, 4, 2, None, sd1["text_encoder"], sd1["unet"])
    randomize_up(net, seed=5)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    weights["lora_unet_not_in_this_model.alpha"] = torch.tensor(1.0)  # extra keys are allowed, as from a file
    fresh = lora.create_network(1.0, 4, 1, None, sd1["text_encoder"], sd1["unet"])
    info = fresh.load_weights(weights)
    assert info.missing_keys == [] and info.unexpected_keys == ["lora_unet_not_in_this_model.alpha"]
    assert all(torch.equal(v, weights[k]) for k, v in fresh.state_dict().items())
    assert fresh.unet_loras[0].scale == 0.5  # the loaded alpha 2 at dim 4, not the network's own alpha 1
    small = {k: v[:2] if k.endswith("lora_down.weight") else v for k, v in weights.items()}
    with pytest.raises(UserError) as e:
        fresh.load_weights(small, source="old.safetensors")
    assert str(e.value).startswith("--network_weights old.safetensors: lora_te_text_model_encoder_layers_0_")
    assert "has shape [2, 32] in the file but [4, 32] in the network" in str(e.value)


# --- per-text-encoder learning rates ---------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Block()


def three_encoder_network(**network_args):
    targets = [LoraTarget(f"lora_te{i}", Encoder(), ("Block",), is_text_encoder=True) for i in (1, 2, 3)]
    return lora.LoRANetwork(targets + toy_targets(Toy()), args=parse_network_args(network_args))


def test_one_learning_rate_per_text_encoder():
    from library.train.optim.lr_schedulers import lr_log_names

    net = three_encoder_network()
    groups, names = net.prepare_optimizer_params([1e-5, 2e-5, 3e-5], 1e-4, 1e-3)
    assert names == ["textencoder 1", "textencoder 2", "textencoder 3", "unet"]
    assert [g["lr"] for g in groups] == [1e-5, 2e-5, 3e-5, 1e-4]
    te3 = {id(p) for m in net.text_encoder_loras if m.lora_name.startswith("lora_te3_") for p in m.parameters()}
    assert {id(p) for p in groups[2]["params"]} == te3 and len(te3) == 4  # lora_te3 -> the third rate
    assert lr_log_names(names) == ["lr/textencoder 1", "lr/textencoder 2", "lr/textencoder 3", "lr/unet"]
    # one rate (or none: --learning_rate) is one group for all encoders, named as for SD
    groups, names = net.prepare_optimizer_params([2e-5], None, 1e-3)
    assert names == ["textencoder", "unet"] and [g["lr"] for g in groups] == [2e-5, 1e-3]
    assert len(groups[0]["params"]) == 12
    groups, names = net.prepare_optimizer_params(None, None, 1e-3)
    assert names == ["textencoder", "unet"] and [g["lr"] for g in groups] == [1e-3, 1e-3]
    # a rate of 0 drops that encoder's group; LoRA+ splits each encoder's group
    plus = three_encoder_network(loraplus_text_encoder_lr_ratio="4")
    groups, names = plus.prepare_optimizer_params([1e-5, 0, 2e-5], 1e-4, 1e-3)
    assert names == ["textencoder 1", "textencoder 1 plus", "textencoder 3", "textencoder 3 plus", "unet"]
    assert [g["lr"] for g in groups] == pytest.approx([1e-5, 4e-5, 2e-5, 8e-5, 1e-4])
    with pytest.raises(ConfigError, match=r"^--text_encoder_lr: expected 1 or 3 values for this model "
                                          r"\(one per text encoder\), got 2$"):
        net.prepare_optimizer_params([1e-5, 2e-5], 1e-4, 1e-3)


# --- tiny SDXL: 23 blocks, 9 / 3 / 9 lr weights, two text encoders ----------------------------------
@pytest.fixture
def sdxl(tiny_sdxl):
    from library.families import get_family

    return get_family("sdxl"), tiny_sdxl


def sdxl_network(sdxl, **network_args):
    family, c = sdxl
    return lora.create_network(1.0, 4, 1, None, c.text_encoders, c.denoiser, lora_targets=family.lora_targets(c),
                               block_layout=family.lora_block_layout(), **network_args)


def test_sdxl_block_layout():
    from networks.lora_args import sdxl_block_layout

    layout = sdxl_block_layout()
    assert (layout.num_blocks, list(layout.down), list(layout.mid), list(layout.up)) == (
        23, list(range(1, 10)), [10, 11, 12], list(range(13, 22)))
    assert layout("lora_unet_input_blocks_4_1_proj_in") == 5 and layout("lora_unet_out_2") == 22
    assert (SD_BLOCK_LAYOUT.num_blocks, len(SD_BLOCK_LAYOUT.down), len(SD_BLOCK_LAYOUT.mid)) == (25, 12, 1)
    assert isinstance(layout, BlockLayout)


def test_sdxl_block_dims_golden(sdxl):
    net = sdxl_network(sdxl, block_dims=",".join(str(i) for i in range(23)),
                       block_alphas=",".join(str(i / 2) for i in range(23)), conv_block_dims=",".join(["3"] * 23))
    got = {m.lora_name: (m.lora_dim, m.alpha.item()) for m in net.unet_loras}
    assert got["lora_unet_input_blocks_1_0_in_layers_2"] == (3, 1.0)  # 3x3 conv: the conv block dim, conv alpha 1
    assert got["lora_unet_input_blocks_1_0_emb_layers_1"] == (2, 1.0)  # IN00 = block 1 holds no LoRA; IN01 = 2
    assert got["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"] == (5, 2.5)
    assert got["lora_unet_input_blocks_8_1_proj_out"] == (9, 4.5)
    assert got["lora_unet_middle_block_0_emb_layers_1"] == (10, 5.0)
    assert got["lora_unet_middle_block_1_transformer_blocks_9_ff_net_2"] == (11, 5.5)
    assert got["lora_unet_middle_block_2_emb_layers_1"] == (12, 6.0)
    assert got["lora_unet_output_blocks_0_1_proj_in"] == (13, 6.5)
    assert got["lora_unet_output_blocks_2_2_conv"] == (3, 1.0)
    assert got["lora_unet_output_blocks_5_1_transformer_blocks_1_attn2_to_k"] == (18, 9.0)
    assert got["lora_unet_output_blocks_8_0_skip_connection"] == (21, 10.5)  # 1x1: the linear block dim
    assert {m.lora_dim for m in net.text_encoder_loras} == {4}
    with pytest.raises(ConfigError) as e:
        sdxl_network(sdxl, block_dims=",".join(["4"] * 25))
    assert str(e.value) == ("--network_args block_dims: expected 23 comma-separated integers for this model "
                            "(emb, IN00-IN08, MID0-MID2, OUT00-OUT08, out), got 25")


def test_sdxl_lr_weights_golden():
    from networks.lora_args import sdxl_block_layout

    layout = sdxl_block_layout()
    a = parse_network_args({"down_lr_weight": "linear", "mid_lr_weight": "0.5", "up_lr_weight": "0,,0.5",
                            "block_lr_zero_threshold": "0.2"}, layout=layout)
    assert a.down_lr_weight == pytest.approx([0.0, 0.0] + [i / 8 for i in range(2, 9)])  # 1/8 <= 0.2 -> 0
    assert a.mid_lr_weight == [0.5, 1.0, 1.0] and a.up_lr_weight == [0.0, 0.0, 0.5] + [1.0] * 6
    assert a.block_lr_weights == pytest.approx([1.0] + a.down_lr_weight + a.mid_lr_weight + a.up_lr_weight + [1.0])
    assert len(a.block_lr_weights) == 23
    assert [i for i, d in enumerate(a.block_dims) if d == 0] == [1, 2, 13, 14]
    cos = parse_network_args({"up_lr_weight": "cosine+1"}, layout=layout).up_lr_weight
    assert len(cos) == 9 and cos[0] == pytest.approx(2.0) and cos[4] == pytest.approx(1 + math.sin(math.pi / 4))
    for key, value, message in (
            ("down_lr_weight", ",".join(["1"] * 12), "expected up to 9 comma-separated numbers for this model or one "
                                                     "of cosine, sine, linear, reverse_linear, zeros[+base], got 12"),
            ("mid_lr_weight", "1,1,1,1", "expected up to 3 comma-separated numbers for this model, got 4 values"),
            ("mid_lr_weight", "cosine", "expected up to 3 comma-separated numbers for this model, got 'cosine'")):
        with pytest.raises(ConfigError) as e:
            parse_network_args({key: value}, layout=layout)
        assert str(e.value).startswith(f"--network_args {key}: ") and message in str(e.value)


def test_sdxl_block_lr_groups_and_per_encoder_rates(sdxl):
    net = sdxl_network(sdxl, down_lr_weight="0,0,0,0,0,1,1,1,1", mid_lr_weight="1,0.5", up_lr_weight="zeros+0.25")
    groups, names = net.prepare_optimizer_params([1e-5, 2e-5], 1.0, 1.0)
    # IN00-IN04 (blocks 1-5) have weight 0: no modules; without conv only attention blocks have modules
    assert names == ["textencoder 1", "textencoder 2", "unet block 6", "unet block 8", "unet block 9",
                     "unet block 11", "unet block 13", "unet block 14", "unet block 15", "unet block 16",
                     "unet block 17", "unet block 18"]
    lrs = dict(zip(names, (g["lr"] for g in groups)))
    assert (lrs["textencoder 1"], lrs["textencoder 2"]) == (1e-5, 2e-5)
    assert (lrs["unet block 6"], lrs["unet block 11"], lrs["unet block 18"]) == (1.0, 0.5, 0.25)
    assert [len(g["params"]) for g in groups[:2]] == [144, 384]  # CLIP-L 72 modules, bigG 192 modules
    assert not any(m.lora_name.startswith("lora_unet_input_blocks_4_") for m in net.unet_loras)
