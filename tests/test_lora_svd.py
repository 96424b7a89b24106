"""The fast factor SVD and the rank rules of resize (sd-scripts' and the score recipes), on constructed spectra."""

import pytest
import torch

from library.core.errors import ConfigError
from networks import lora_svd
from networks.lora_files import LoraModule
from networks.lora_resize import ResizeOptions, resize_modules
from networks.lora_svd import RankRule, choose_rank, parse_recipe, recipe_rank

SPECTRUM = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5])


@pytest.mark.parametrize("method,param,expected", [
    ("sv_ratio", 2.0, 2),        # #{S > 4} = 1 -> 1 + 1
    ("sv_ratio", 10.0, 5),       # #{S > 0.8} = 4 -> 4 + 1
    ("sv_cumulative", 0.5, 2),   # cumsum/15.5 = .52 .77 .90 .97 1 -> idx 0 + 1 = 1 -> 2
    ("sv_cumulative", 0.9, 4),   # idx 2 + 1 = 3 -> 4
    ("sv_fro", 0.9, 3),          # cumsum S²/85.25 = .75 .94 ... reaches .81 at idx 1 -> 2 -> 3
    ("sv_fro", 0.99, 4),         # .9801 reached at idx 2 -> 3 -> 4
])
def test_dynamic_methods_pick_sd_scripts_rank(method, param, expected):
    assert choose_rank(SPECTRUM, RankRule(16, method, param), full_len=320) == expected


def test_index_is_clamped_then_incremented_then_capped():
    # all five above S0/100: index 5 is clamped to full_len - 1 = 4, then + 1 = 5
    assert choose_rank(SPECTRUM, RankRule(16, "sv_ratio", 100.0), full_len=5) == 5
    assert choose_rank(SPECTRUM, RankRule(16, "sv_ratio", 100.0), full_len=320) == 6  # sd-scripts rule, uncapped
    assert choose_rank(SPECTRUM, RankRule(3, "sv_ratio", 100.0), full_len=320) == 3  # capped at new_rank
    # the lower clamp: sv_ratio 1 counts nothing (S > S0 is empty) -> 1 -> 2
    assert choose_rank(SPECTRUM, RankRule(16, "sv_ratio", 1.0), full_len=320) == 2
    assert choose_rank(SPECTRUM, RankRule(7), full_len=320) == 7  # fixed mode
    assert choose_rank(torch.tensor([1e-7, 0.0]), RankRule(8, "sv_fro", 0.9), full_len=320) == 1  # zero matrix


def test_score_recipes_against_base_norms():
    base = 10 * torch.eye(4)  # Frobenius 20, spectral 10
    fro = parse_recipe("fro_ckpt=1,thr=-1")  # keep σ > 20 · 10^-1 = 2
    assert recipe_rank(SPECTRUM, fro, base) == 2
    assert recipe_rank(SPECTRUM, parse_recipe("spn_ckpt=1,thr=-1"), base) == 3  # σ > 1
    assert recipe_rank(SPECTRUM, parse_recipe("spn_lora,thr=-0.7"), None) == 3  # σ > 8 · 10^-0.7 = 1.6
    mixed = parse_recipe("fro_ckpt=1,spn_lora=1,thr=-1")  # weights normalised to 0.5 each
    assert mixed.weights["fro_ckpt"] == 0.5 and mixed.weights["spn_lora"] == 0.5
    assert recipe_rank(SPECTRUM, mixed, base) == 3  # ref = sqrt(20·8) ≈ 12.6 -> σ > 1.26


def test_recipe_errors_name_the_flag():
    with pytest.raises(ConfigError, match=r"--dynamic_param: unknown recipe key 'size'.*not supported"):
        parse_recipe("fro_ckpt=1,size=50")
    with pytest.raises(ConfigError, match=r"needs thr="):
        parse_recipe("fro_ckpt=1")
    with pytest.raises(ConfigError, match=r"needs --base_model"):
        recipe_rank(SPECTRUM, parse_recipe("fro_ckpt=1,thr=-3"), None)


def test_factor_svd_matches_full_svd():
    torch.manual_seed(0)
    up, down = torch.randn(640, 32), torch.randn(32, 2048)
    fast, full = lora_svd.factor_svd(up, down), lora_svd.full_svd(up @ down)
    dw = up @ down
    assert float((fast.matrix() - dw).norm() / dw.norm()) < 1e-5
    assert torch.allclose(fast.S, full.S[:32], rtol=1e-4)
    k = 8
    err = (fast.truncate(k).matrix() - full.truncate(k).matrix()).norm() / full.truncate(k).matrix().norm()
    assert float(err) < 1e-4


def test_retained_fractions():
    sum_frac, fro_frac, ratio = lora_svd.retained_fractions(SPECTRUM, 2)
    assert sum_frac == pytest.approx(12 / 15.5)
    assert fro_frac == pytest.approx((80 / 85.25) ** 0.5)
    assert ratio == pytest.approx(2.0)


def _module(name, out, inn, rank, alpha, kernel=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kernel:
        return LoraModule(name, torch.randn(rank, inn, kernel, kernel, generator=g),
                          torch.randn(out, rank, 1, 1, generator=g), alpha)
    return LoraModule(name, torch.randn(rank, inn, generator=g), torch.randn(out, rank, generator=g), alpha)


def test_resize_to_same_rank_reproduces_delta():
    modules = {m.name: m for m in (_module("lora_unet_a", 96, 64, 8, 4.0), _module("lora_unet_conv", 32, 16, 4, 1.0, 3),
                                   _module("lora_te_b", 64, 64, 8, None))}
    result = resize_modules(modules, ResizeOptions(new_rank=8))
    for new in result.modules:
        old = modules[new.name]
        assert new.rank == old.rank and new.down.shape == old.down.shape and new.up.shape == old.up.shape
        assert float((new.delta() - old.delta()).norm() / old.delta().norm()) < 1e-5
    assert [r.new_rank for r in result.reports] == [8, 4, 8]
    assert result.modules[0].alpha == pytest.approx(4.0)  # alpha = scale · k = 0.5 · 8


def test_fast_resize_equals_full_svd_resize():
    modules = {"lora_unet_a": _module("lora_unet_a", 320, 768, 32, 16.0, seed=1)}
    fast = resize_modules(modules, ResizeOptions(new_rank=8)).modules[0].delta()
    full = resize_modules(modules, ResizeOptions(new_rank=8, svd="full")).modules[0].delta()
    assert float((fast - full).norm() / full.norm()) < 1e-4


def test_resize_conv_rank_and_dynamic_reports():
    modules = {m.name: m for m in (_module("lora_unet_a", 96, 64, 8, 8.0), _module("lora_unet_c", 32, 16, 8, 8.0, 3))}
    result = resize_modules(modules, ResizeOptions(new_rank=4, new_conv_rank=2))
    assert [m.rank for m in result.modules] == [4, 2]
    assert [tuple(m.down.shape) for m in result.modules] == [(4, 64), (2, 16, 3, 3)]
    with pytest.raises(ConfigError, match="--dynamic_param: required with --dynamic_method sv_fro"):
        resize_modules(modules, ResizeOptions(new_rank=4, dynamic_method="sv_fro"))


def test_extract_clamp_is_sign_invariant_and_keeps_a_rank_one_change():
    from networks.lora_extract import extract_module

    # A uniform shift of a layer: sd-scripts' signed-quantile clamp returns it intact, at 5/8 of its size
    # or as nothing, depending on the signs the SVD happens to give (all four occur here).
    for shape in ((32, 160), (160, 32)):
        for diff in (torch.full(shape, 0.05), torch.full(shape, -0.05)):
            for method in ("full", "randomized"):
                module = extract_module("m", diff, rank=2, clamp_quantile=0.99, method=method)
                torch.testing.assert_close(module.up @ module.down, diff, rtol=0, atol=1e-6)
    gen = torch.Generator().manual_seed(0)
    noisy = torch.randn(64, 48, generator=gen) @ torch.diag(torch.linspace(2, 0.01, 48)) @ torch.randn(48, 48, generator=gen)
    plus = extract_module("m", noisy, rank=4, method="full")
    minus = extract_module("m", -noisy, rank=4, method="full")
    torch.testing.assert_close(minus.up @ minus.down, -(plus.up @ plus.down), rtol=1e-5, atol=1e-6)
