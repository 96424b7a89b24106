"""SD3's emb_dims and split_qkv network args: sd-scripts' lora_sd3.py names and counts on the full-size models (meta
device), and a tiny run whose split qkv file is block-diagonal and applies each projection's own LoRA."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.families import get_family
from library.families.sd3 import layout as sai
from library.families.base import Components
from library.families.sd3.configs import PRESETS, transformer_config
from networks.lora import create_network, create_network_from_weights
from tests.train_helpers import base_args, make_dataset, make_trainer

# sd-scripts' emb_dims filters, in order, applied to every module name of the SAI MMDiT outside the joint blocks
EMB_FILTERS = ("context_embedder", "_t_embedder", "x_embedder", "y_embedder", "final_layer_adaLN_modulation",
               "final_layer_linear")


def _meta_transformer(preset: str):
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        return Components(SD3Transformer2DModel(**transformer_config(PRESETS[preset])), None, [], [])


def _sai_module_names(c) -> list[str]:
    """`lora_unet_<SAI path>` of every weight of the transformer's SAI single-file layout (the names sd-scripts'
    lora_sd3.py gives the Linear / Conv2d owning it)."""
    keys = [sai.diffusers_key_to_sai(k)[0] for k in c.denoiser.state_dict()]
    return ["lora_unet_" + k[:-len(".weight")].replace(".", "_") for k in keys if k.endswith(".weight")]


@pytest.mark.parametrize("preset,block_modules,qkv_modules", [("random:sd3-medium", 237, 48),
                                                              ("random:sd3.5-medium", 263, 61)])
def test_full_size_emb_dims_and_split_qkv_on_meta(preset, block_modules, qkv_modules):
    family, c = get_family("sd3"), _meta_transformer(preset)
    net = create_network(1.0, 4, 8, None, None, None, lora_targets=family.lora_targets(c),
                         emb_dims="[2,3,5,6,7,9]", split_qkv="True")
    by_name = {lora.lora_name: lora for lora in net.unet_loras}
    names = _sai_module_names(c)
    expected_emb = {n for n in names if not n.startswith("lora_unet_joint_blocks_") and any(f in n for f in EMB_FILTERS)}
    assert len(expected_emb) == 8 and len(by_name) == block_modules + 8
    assert {n for n in by_name if not n.startswith("lora_unet_joint_blocks_")} == expected_emb
    dims = {n: by_name[n].lora_dim for n in expected_emb}
    assert dims == {"lora_unet_context_embedder": 2, "lora_unet_t_embedder_mlp_0": 3, "lora_unet_t_embedder_mlp_2": 3,
                    "lora_unet_x_embedder_proj": 5, "lora_unet_y_embedder_mlp_0": 6, "lora_unet_y_embedder_mlp_2": 6,
                    "lora_unet_final_layer_adaLN_modulation_1": 7, "lora_unet_final_layer_linear": 9}
    assert by_name["lora_unet_x_embedder_proj"].lora_down.weight.shape == (5, 16, 2, 2)  # the 2x2 patch conv
    assert by_name["lora_unet_x_embedder_proj"].lora_up.weight.shape == (1536, 5, 1, 1)
    # split_qkv: sd-scripts splits every joint-block module with "qkv" in its name (SD3.5's attn2 too)
    split = {n for n, lora in by_name.items() if getattr(lora, "split", False)}
    assert len(split) == qkv_modules and split == {n for n in names if n.startswith("lora_unet_joint_blocks_")
                                                   and "qkv" in n}
    qkv = by_name["lora_unet_joint_blocks_0_x_block_attn_qkv"]
    assert (qkv.lora_down.weight.shape, qkv.lora_up.weight.shape) == ((12, 1536), (3 * 1536, 12))
    assert qkv.scale == pytest.approx(8 / 4)  # sd-scripts' per-projection alpha / dim
    assert by_name["lora_unet_joint_blocks_0_x_block_attn_proj"].lora_dim == 4


def test_defaults_add_nothing(tiny_sd3):
    family = get_family("sd3")
    plain = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(tiny_sd3))
    off = create_network(1.0, 4, 1, None, None, None, lora_targets=family.lora_targets(tiny_sd3),
                         emb_dims="[0,0,0,0,0,0]", split_qkv="False")
    assert [lora.lora_name for lora in off.unet_loras] == [lora.lora_name for lora in plain.unet_loras]
    assert not any(getattr(lora, "split", False) for lora in off.unet_loras)


@pytest.mark.parametrize("args,error", [
    ({"emb_dims": "[4,4,4,4,4]"}, "--network_args emb_dims: expected 6 comma-separated integers >= 0 "
                                  "[context,t,x,y,final_mod,final_linear], got 5 values"),
    ({"emb_dims": "[4,4,x,4,4,4]"}, "--network_args emb_dims: expected 6 comma-separated integers >= 0"),
    ({"split_qkv": "yes please"}, "--network_args split_qkv: expected True or False, got 'yes please'"),
])
def test_bad_values_are_one_line_errors(tiny_sd3, args, error):
    with pytest.raises(ConfigError, match="^" + re.escape(error)):
        create_network(1.0, 4, 1, None, None, None, lora_targets=get_family("sd3").lora_targets(tiny_sd3), **args)


def test_tiny_run_saves_a_block_diagonal_qkv_that_applies_each_projections_lora(tmp_path, tiny_sd3_copy):
    """2 steps with split_qkv and emb_dims: the file has the unsplit key set plus the 8 emb modules, each qkv's up is
    block-diagonal (3 ranks of 4), alpha is 3·alpha, and the file's modules on a fresh model give to_q / to_k / to_v
    exactly up_i @ down_i · alpha / 4 (sd-scripts' per-projection scale), as the trained network did."""
    data = make_dataset(str(tmp_path), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / "out"), "tiny:sd3", steps=2, extra=[
        "--network_module", "networks.lora_sd3", "--network_alpha", "2", "--t5xxl_max_token_length", "8",
        "--cache_text_encoder_outputs", "--network_train_unet_only", "--network_args", "split_qkv=True",
        "emb_dims=[4,4,4,4,4,4]"]), "sd3")
    sd = load_file(trainer.run())
    modules = {k.split(".")[0] for k in sd}
    assert len(modules) == 29 + 8 and {m for m in modules if "joint_blocks" not in m} == {
        "lora_unet_context_embedder", "lora_unet_t_embedder_mlp_0", "lora_unet_t_embedder_mlp_2",
        "lora_unet_x_embedder_proj", "lora_unet_y_embedder_mlp_0", "lora_unet_y_embedder_mlp_2",
        "lora_unet_final_layer_adaLN_modulation_1", "lora_unet_final_layer_linear"}
    assert all(sd[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)  # every module trained
    name = "lora_unet_joint_blocks_1_x_block_attn_qkv"
    down, up, alpha = sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"], sd[f"{name}.alpha"]
    hidden = tiny_sd3_copy.denoiser.config.num_attention_heads * tiny_sd3_copy.denoiser.config.attention_head_dim
    assert down.shape == (12, hidden) and up.shape == (3 * hidden, 12) and float(alpha) == 6.0
    for i in range(3):
        rows = slice(i * hidden, (i + 1) * hidden)
        for j in range(3):
            block = up[rows, j * 4:(j + 1) * 4]
            assert (block.abs().sum() > 0) if i == j else torch.equal(block, torch.zeros_like(block))

    c = tiny_sd3_copy
    attn = c.denoiser.transformer_blocks[1].attn
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = [p(x) for p in (attn.to_q, attn.to_k, attn.to_v)]
        net, _ = create_network_from_weights(1.0, None, None, c.text_encoders, c.denoiser, weights_sd=sd,
                                             lora_targets=get_family("sd3").lora_targets(c))
        net.apply_to(c.text_encoders, c.denoiser, apply_text_encoder=False)
        net.load_weights(sd)
        loaded = [p(x) for p in (attn.to_q, attn.to_k, attn.to_v)]
        trained_net = trainer.network
        trained_net.restore()
        trained_net.to(torch.float32)
        net.restore()
        trained = trainer.components.denoiser.transformer_blocks[1].attn
        for module in trained_net.unet_loras:
            module.apply_to()
        from_training = [p(x) for p in (trained.to_q, trained.to_k, trained.to_v)]
    for i in range(3):
        want = base[i] + (x @ down[i * 4:(i + 1) * 4].T @ up[i * hidden:(i + 1) * hidden, i * 4:(i + 1) * 4].T) * (2 / 4)
        torch.testing.assert_close(loaded[i], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_training, loaded, rtol=1e-5, atol=1e-5)


def test_fine_tune_trains_t5xxl_with_train_t5xxl(tmp_path):
    """sd3_train.py --train_text_encoder --train_t5xxl: CLIP-L, CLIP-G and T5-XXL all train, T5 at
    --learning_rate_te3 (0 keeps it frozen, as sd-scripts), and the saved single file holds the trained T5."""
    from library.cli.entry import run_training
    from library.families.base import LoadOptions
    from library.train.adapters.trainables import fine_tune_plan
    from tests.train_helpers import ft_args, ft_trainer

    family = get_family("sd3")
    base = family.load(LoadOptions("tiny:sd3"))
    data = make_dataset(str(tmp_path), n=1)

    def moved(name: str, extra: list) -> list:
        out = str(tmp_path / name)
        assert run_training("sd3", "test", ft_args(data, out, preset="tiny:sd3", steps=1, extra=[
            "--t5xxl_max_token_length", "8", "--train_text_encoder", "--train_t5xxl", *extra]), fine_tune=True) == 0
        loaded = family.load(LoadOptions(f"{out}/model.safetensors"))
        return [any(not torch.equal(x, y) for x, y in zip(m.state_dict().values(), n.state_dict().values()))
                for m, n in zip(loaded.text_encoders, base.text_encoders)]

    assert moved("all", ["--learning_rate_te3", "1e-3"]) == [True, True, True]
    trainer = ft_trainer(ft_args(data, str(tmp_path / "plan"), preset="tiny:sd3", extra=[
        "--train_text_encoder", "--train_t5xxl", "--learning_rate_te2", "2e-5", "--learning_rate_te3", "0"]), "sd3")
    assert fine_tune_plan(trainer.s.fine_tune, 1e-3, 3) == {"denoiser": 1e-3, "text_encoder1": 1e-3,
                                                             "text_encoder2": 2e-5}  # te3 0: T5 frozen


@pytest.mark.parametrize("flags,error", [
    (["--train_t5xxl"], "error: --train_t5xxl: needs --train_text_encoder"),
    (["--train_text_encoder", "--train_t5xxl", "--cache_text_encoder_outputs"],
     "error: --train_t5xxl: T5-XXL's outputs cannot be cached while it trains; drop --cache_text_encoder_outputs"),
    (["--train_text_encoder", "--learning_rate_te3", "1e-5"],
     "error: --learning_rate_te3: T5-XXL trains only with --train_t5xxl; add it or drop the rate"),
])
def test_train_t5xxl_flags_refused_with_one_line(tmp_path, capsys, flags, error):
    from library.cli.entry import run_training
    from tests.train_helpers import ft_args

    data = make_dataset(str(tmp_path), n=1)
    assert run_training("sd3", "test", ft_args(data, str(tmp_path / "o"), preset="tiny:sd3", extra=flags),
                        fine_tune=True) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(error)


def test_num_last_block_to_freeze_freezes_the_last_joint_blocks(tmp_path):
    """sd3_train.py --num_last_block_to_freeze 1: after a step the last joint block is unchanged and the
    one before it moved; in a LoRA script the flag is refused."""
    import torch

    from library.cli.entry import run_training
    from library.families.base import LoadOptions
    from tests.train_helpers import ft_args

    family = get_family("sd3")
    base = family.load(LoadOptions("tiny:sd3"))
    data = make_dataset(str(tmp_path), n=1)
    out = str(tmp_path / "o")
    assert run_training("sd3", "test", ft_args(data, out, preset="tiny:sd3", steps=1, extra=[
        "--t5xxl_max_token_length", "8", "--num_last_block_to_freeze", "1"]), fine_tune=True) == 0
    loaded = family.load(LoadOptions(f"{out}/model.safetensors")).denoiser.transformer_blocks
    before = base.denoiser.transformer_blocks
    moved = [any(not torch.equal(a, b) for a, b in zip(x.state_dict().values(), y.state_dict().values()))
             for x, y in zip(loaded, before)]
    assert moved[-1] is False and moved[-2] is True


def test_use_t5xxl_cache_only_turns_the_cache_on():
    from library.cli.text_cache import text_cache_options_from_args

    assert text_cache_options_from_args({"use_t5xxl_cache_only": True}).enabled
    assert not text_cache_options_from_args({}).enabled


def test_use_t5xxl_cache_only_trains_clip_with_t5_cached(tmp_path, capsys):
    from library.cli.entry import run_training
    from tests.train_helpers import ft_args

    data = make_dataset(str(tmp_path), n=1)
    assert run_training("sd3", "test", ft_args(data, str(tmp_path / "o"), preset="tiny:sd3", steps=1, extra=[
        "--t5xxl_max_token_length", "8", "--train_text_encoder", "--use_t5xxl_cache_only"]), fine_tune=True) == 0
    assert run_training("sd3", "test", ft_args(data, str(tmp_path / "o2"), preset="tiny:sd3", extra=[
        "--num_last_block_to_freeze", "1", "--network_module", "networks.lora"])) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --num_last_block_to_freeze: a full fine-tune flag (sd3_train.py); a LoRA trains no block weights "
        "to freeze")
