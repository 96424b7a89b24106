"""FLUX.1 networks.lora_flux `split_qkv=True` (one LoRA per projection of the fused qkv / linear1, saved in the
fused kohya layout) and LoRA-GGPO (`ggpo_sigma` / `ggpo_beta`, training-only perturbation)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from library.families import get_family
from library.families.base import Components
from library.families.flux.configs import build_flux_modules
from networks.lora import create_network, create_network_from_weights
from tests.train_helpers import base_args, make_dataset, make_trainer


def _net(c, dim=4, alpha=2.0, **args):
    return create_network(1.0, dim, alpha, None, c.text_encoders, c.denoiser,
                          lora_targets=get_family("flux").lora_targets(c), **args)


def test_split_qkv_modules_on_the_full_size_dev():
    """flux-dev: 19 double blocks x (img, txt) qkv + 38 single linear1 = 76 split modules, exact names and shapes."""
    parts = build_flux_modules("random:flux-dev", device="meta")
    c = Components(parts["transformer"], None, [parts["text_encoder"], parts["text_encoder_2"]], [])
    net = _net(c, split_qkv="True")
    by_name = {lora.lora_name: lora for lora in net.unet_loras}
    split = sorted(n for n, lora in by_name.items() if getattr(lora, "split", False))
    assert split == sorted([f"lora_unet_double_blocks_{i}_{k}_attn_qkv" for i in range(19) for k in ("img", "txt")]
                           + [f"lora_unet_single_blocks_{i}_linear1" for i in range(38)])
    assert len(by_name) == 19 * 10 + 38 * 3  # the same modules as without split_qkv
    assert sorted(by_name) == sorted(lora.lora_name for lora in _net(c).unet_loras)
    qkv, lin1 = by_name["lora_unet_double_blocks_0_img_attn_qkv"], by_name["lora_unet_single_blocks_0_linear1"]
    assert (qkv.lora_down.weight.shape, qkv.lora_up.weight.shape) == ((12, 3072), (3 * 3072, 12))
    assert (lin1.lora_down.weight.shape, lin1.lora_up.weight.shape) == ((16, 3072), (3 * 3072 + 12288, 16))
    assert qkv.scale == lin1.scale == pytest.approx(2.0 / 4)  # alpha n·2 over rank n·4: sd-scripts' per-projection 2/4
    assert not getattr(by_name["lora_unet_double_blocks_0_img_attn_proj"], "split", False)


@pytest.fixture(scope="module")
def split_run(tmp_path_factory, tiny_store):
    tmp = tmp_path_factory.mktemp("split")
    data = make_dataset(str(tmp), n=2)
    trainer = make_trainer(base_args(data, str(tmp / "out"), "tiny:flux", steps=2, extra=[
        "--network_alpha", "2", "--t5xxl_max_token_length", "8", "--network_train_unet_only",
        "--network_args", "split_qkv=True"]), "flux")
    return load_file(trainer.run())


def _blocks(up: torch.Tensor, sizes: list[int], rank: int):
    start = 0
    for i, size in enumerate(sizes):
        for j in range(len(sizes)):
            yield i, j, up[start:start + size, j * rank:(j + 1) * rank]
        start += size


def test_split_run_saves_the_fused_block_diagonal_layout(split_run, tiny_flux):
    """2 steps on tiny:flux: the same module names as an unsplit file, each qkv / linear1 of rank n·4 with a
    block-diagonal up (off-diagonal blocks exactly zero, diagonal ones trained) and alpha n·2."""
    sd = split_run
    t = tiny_flux.denoiser.config
    hidden = t.num_attention_heads * t.attention_head_dim
    modules = {k.split(".")[0] for k in sd}
    unsplit = {lora.lora_name for lora in _net(tiny_flux).unet_loras}
    assert modules == unsplit and len(modules) == 2 * 10 + 3 * 3
    assert {k.split(".", 1)[1] for k in sd} == {"lora_down.weight", "lora_up.weight", "alpha"}
    mlp = tiny_flux.denoiser.single_transformer_blocks[0].proj_mlp.out_features
    for name, sizes in (("lora_unet_double_blocks_1_img_attn_qkv", [hidden] * 3),
                        ("lora_unet_double_blocks_0_txt_attn_qkv", [hidden] * 3),
                        ("lora_unet_single_blocks_2_linear1", [hidden] * 3 + [mlp])):
        down, up = sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"]
        n = len(sizes)
        assert down.shape == (4 * n, hidden) and up.shape == (sum(sizes), 4 * n)
        assert float(sd[f"{name}.alpha"]) == 2.0 * n
        for i, j, block in _blocks(up, sizes, 4):
            assert (block.abs().sum() > 0) if i == j else torch.equal(block, torch.zeros_like(block))
    assert sd["lora_unet_double_blocks_0_img_attn_proj.lora_down.weight"].shape == (4, hidden)


def test_split_file_delta_is_the_concatenation_and_merges_like_the_modules(split_run, tiny_flux_copy):
    """The fused ΔW = cat(up_i @ down_i) · alpha/dim per projection; merging the file into a copy of the model gives
    the same q / k / v / mlp outputs as the file's modules applied on top of the base."""
    sd = {k: v.float() for k, v in split_run.items()}
    c = tiny_flux_copy
    family = get_family("flux")
    merged_c = copy.deepcopy(c)
    net, _ = create_network_from_weights(1.0, None, None, c.text_encoders, c.denoiser, weights_sd=sd,
                                         lora_targets=family.lora_targets(c))
    net.load_weights(sd)
    name = "lora_unet_single_blocks_1_linear1"
    lora = {m.lora_name: m for m in net.unet_loras}[name]
    down, up = sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"]
    sizes = lora.out_sizes
    parts, start = [], 0
    for i, size in enumerate(sizes):
        parts.append(up[start:start + size, i * 4:(i + 1) * 4] @ down[i * 4:(i + 1) * 4] * (2.0 / 4))
        start += size
    torch.testing.assert_close(lora.delta_weight(), torch.cat(parts), rtol=0, atol=1e-7)

    merging, _ = create_network_from_weights(1.0, None, None, merged_c.text_encoders, merged_c.denoiser,
                                             weights_sd=sd, lora_targets=family.lora_targets(merged_c))
    merging.merge_to(merged_c.text_encoders, merged_c.denoiser, weights_sd=sd)
    net.apply_to(c.text_encoders, c.denoiser, apply_text_encoder=False)
    hidden = lora.lora_down.weight.shape[1]
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for block, m_block in ((c.denoiser.single_transformer_blocks[1], merged_c.denoiser.single_transformer_blocks[1]),
                               (c.denoiser.transformer_blocks[1], merged_c.denoiser.transformer_blocks[1])):
            names = ["attn.to_q", "attn.to_k", "attn.to_v"] + (["proj_mlp"] if hasattr(block, "proj_mlp")
                                                               else ["attn.add_q_proj", "attn.add_k_proj"])
            for path in names:
                applied = block.get_submodule(path)(x)
                baked = m_block.get_submodule(path)(x)
                # same math, different order (x·(W+ΔW)ᵀ vs x·Wᵀ + x·ΔWᵀ): float32 rounding, measured < 1e-6
                torch.testing.assert_close(baked, applied, rtol=1e-5, atol=1e-5)
    net.restore()


# --- LoRA-GGPO --------------------------------------------------------------------------------------------------

def test_ggpo_perturbs_only_while_training_after_norms(tiny_flux_copy):
    c = tiny_flux_copy
    net = _net(c, ggpo_sigma="0.5", ggpo_beta="0.5")
    plain = _net(c)
    assert net.ggpo and not plain.ggpo
    assert all(lora.ggpo is not None for lora in net.unet_loras)  # every FLUX LoRA is on Linear layers
    net.apply_to(c.text_encoders, c.denoiser, apply_text_encoder=False)
    qkv = {m.lora_name: m for m in net.unet_loras}["lora_unet_double_blocks_0_img_attn_qkv"]
    q = c.denoiser.transformer_blocks[0].attn.to_q
    x = torch.randn(2, 3, q.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = qkv._org_forwards[0](x)
    net.train()
    torch.testing.assert_close(q(x), base, rtol=0, atol=0)  # no norms yet: the first step is unperturbed
    for lora in net.unet_loras:
        lora.lora_up.weight.data.normal_()
    q(x).sum().backward()
    net.update_grad_norms()
    net.update_norms()
    assert qkv.ggpo.grad_norms.shape == (3 * q.out_features, 1) and qkv.ggpo.combined_weight_norms.min() > 0
    with torch.no_grad():
        lora_only = q(x)
        net.eval()
        eval_out = q(x)
        net.train()
    assert (lora_only - eval_out).abs().max() > 1e-3  # perturbed while training
    assert set(net.ggpo_logs()) == {"ggpo/mean_weight_norm", "ggpo/mean_grad_norm", "ggpo/mean_combined_norm"}
    net.restore()


def _train(tmp_path, sub, extra_args):
    data = make_dataset(str(tmp_path / sub), n=2)
    trainer = make_trainer(base_args(data, str(tmp_path / sub / "out"), "tiny:flux", steps=3, extra=[
        "--t5xxl_max_token_length", "8", "--network_train_unet_only", "--seed", "7", *extra_args]), "flux")
    return load_file(trainer.run())


def test_ggpo_run_differs_and_saves_the_same_keys(tmp_path):
    """3 steps with and without GGPO from the same seed: same keys, shapes and dtypes; different weights (step 1 is
    unperturbed, steps 2-3 are not)."""
    plain = _train(tmp_path, "plain", [])
    ggpo = _train(tmp_path, "ggpo", ["--network_args", "ggpo_sigma=0.5", "ggpo_beta=0.5"])
    assert sorted(ggpo) == sorted(plain)
    assert all(ggpo[k].shape == plain[k].shape and ggpo[k].dtype == plain[k].dtype for k in plain)
    differing = [k for k in plain if not torch.equal(plain[k], ggpo[k])]
    assert len(differing) > len(plain) // 2


def test_ggpo_and_split_with_a_file_shaped_network(tiny_flux, caplog):
    """--dim_from_weights: GGPO still attaches (train-only); split_qkv warns that the file's fused modules train
    unsplit."""
    c = tiny_flux
    sd = _net(c).state_dict()
    net, _ = create_network_from_weights(1.0, None, None, c.text_encoders, c.denoiser, weights_sd=sd,
                                         lora_targets=get_family("flux").lora_targets(c), ggpo_sigma="0.1",
                                         ggpo_beta="0.1", split_qkv="True")
    assert net.ggpo and all(lora.ggpo is not None for lora in net.unet_loras)
    assert not any(getattr(lora, "split", False) for lora in net.unet_loras)
    assert "split_qkv: the modules come from a file" in caplog.text
