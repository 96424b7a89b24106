"""DDPM scheme vs diffusers, and the noise options drawn from a torch.Generator."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler

from library.core.errors import ConfigError
from library.objectives.noise import (
    DDPMScheme,
    NoiseOptions,
    make_noise,
    perturb_for_input,
)

SHAPE = (2, 4, 8, 8)


def diffusers_scheduler(zero_terminal_snr=False, prediction_type="epsilon"):
    return DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                         clip_sample=False, prediction_type=prediction_type, rescale_betas_zero_snr=zero_terminal_snr)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("zero_terminal_snr", [False, True])
def test_alphas_cumprod_equal_diffusers(zero_terminal_snr):
    ref = diffusers_scheduler(zero_terminal_snr)
    scheme = DDPMScheme(zero_terminal_snr=zero_terminal_snr)
    assert scheme.alphas_cumprod.dtype == torch.float32
    assert torch.equal(scheme.betas, ref.betas)
    assert torch.equal(scheme.alphas_cumprod, ref.alphas_cumprod)


def test_alphas_cumprod_golden_values():
    ac = DDPMScheme().alphas_cumprod
    assert ac[0].item() == pytest.approx(0.99915, abs=1e-6)
    assert ac[500].item() == pytest.approx(0.2763327, abs=1e-6)  # float64 reference: 0.27633268
    assert ac[999].item() == pytest.approx(0.0046601, abs=1e-6)


@pytest.mark.parametrize("zero_terminal_snr", [False, True])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_add_noise_and_target_equal_diffusers(zero_terminal_snr, prediction_type):
    ref = diffusers_scheduler(zero_terminal_snr, prediction_type)
    scheme = DDPMScheme(prediction_type, zero_terminal_snr=zero_terminal_snr)
    g = gen(1)
    x, n = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([0, 500, 999])
    assert torch.equal(scheme.add_noise(x, n, t), ref.add_noise(x, n, t))
    expected = ref.get_velocity(x, n, t) if prediction_type == "v_prediction" else n
    assert torch.allclose(scheme.target(x, n, t), expected, atol=1e-6, rtol=0)


def test_zero_terminal_snr_last_step():
    scheme = DDPMScheme("v_prediction", zero_terminal_snr=True)
    t = torch.tensor([0, 999])
    assert scheme.alphas_cumprod[-1].item() == 0.0
    # first alpha_cumprod is kept by the rescale
    assert scheme.alphas_cumprod[0].item() == pytest.approx(0.99915, abs=1e-6)
    snr = scheme.snr(t)
    assert snr[1].item() == pytest.approx(1e-8)  # floored, not 0, so 1/SNR weights stay finite
    assert torch.isinf(scheme.sigmas(t)[1])
    x = torch.ones(2, 1, 2, 2)
    n = torch.full((2, 1, 2, 2), 3.0)
    assert torch.equal(scheme.add_noise(x, n, t)[1], n[1])  # pure noise at the last step
    assert torch.equal(scheme.target(x, n, t)[1], -x[1])  # v = -x0 there


def test_snr_and_sigmas_golden():
    scheme = DDPMScheme()
    t = torch.tensor([0, 500, 999])
    assert scheme.snr(t).tolist() == pytest.approx([1175.4706, 0.381850, 0.0046819], rel=1e-4)
    assert scheme.sigmas(t).tolist() == pytest.approx([0.0291672, 1.618279, 14.61464], rel=1e-4)


def test_sample_timesteps_deterministic_and_in_range():
    scheme = DDPMScheme()
    t = scheme.sample_timesteps(64, 100, 200, generator=gen(3))
    assert t.dtype == torch.long and t.shape == (64,)
    assert int(t.min()) >= 100 and int(t.max()) < 200
    assert torch.equal(t, torch.randint(100, 200, (64,), generator=gen(3)))
    assert torch.equal(scheme.sample_timesteps(4, None, None, generator=gen(3)),
                       torch.randint(0, 1000, (4,), generator=gen(3)))
    assert scheme.sample_timesteps(3, 500, 500).tolist() == [500, 500, 500]  # equal bounds pin t (sd-scripts)
    with pytest.raises(ConfigError, match="min_timestep"):
        scheme.sample_timesteps(2, 600, 500)


def test_unknown_prediction_type():
    with pytest.raises(ConfigError, match="prediction_type"):
        DDPMScheme("sample")


def test_plain_noise_is_randn_from_generator():
    latents = torch.zeros(SHAPE)
    assert torch.equal(make_noise(latents, NoiseOptions(), gen(5)), torch.randn(SHAPE, generator=gen(5)))


def test_noise_offset_adds_per_channel_constant():
    latents = torch.zeros(SHAPE)
    out = make_noise(latents, NoiseOptions(noise_offset=0.1), gen(7))
    g = gen(7)
    base = torch.randn(SHAPE, generator=g)
    offset = torch.randn(2, 4, 1, 1, generator=g)
    assert torch.equal(out, base + 0.1 * offset)
    # the difference to the base noise is constant over each (sample, channel) plane
    diff = out - base
    assert torch.allclose(diff, 0.1 * offset.expand_as(diff), atol=1e-6)


def test_noise_offset_random_strength_and_adaptive_scale():
    latents = torch.arange(2 * 4 * 8 * 8, dtype=torch.float32).reshape(SHAPE) / 100 - 2.0
    opts = NoiseOptions(noise_offset=0.1, noise_offset_random_strength=True, adaptive_noise_scale=0.5)
    out = make_noise(latents, opts, gen(11))
    g = gen(11)
    base = torch.randn(SHAPE, generator=g)
    strength = torch.rand(1, generator=g) * 0.1
    offset = (strength + 0.5 * latents.mean(dim=(2, 3), keepdim=True).abs()).clamp_min(0)
    expected = base + offset * torch.randn(2, 4, 1, 1, generator=g)
    assert torch.equal(out, expected)


def test_multires_noise_hand_computed():
    latents = torch.zeros(SHAPE)
    out = make_noise(latents, NoiseOptions(multires_noise_iterations=3, multires_noise_discount=0.3), gen(13))
    g = gen(13)
    expected = torch.randn(SHAPE, generator=g)
    for i in range(3):
        r = torch.rand(1, generator=g).item() * 2 + 2
        size = (max(1, int(8 / r**i)), max(1, int(8 / r**i)))
        level = torch.randn(2, 4, *size, generator=g)
        expected = expected + F.interpolate(level, size=(8, 8), mode="bilinear", align_corners=False) * 0.3**i
        if 1 in size:
            break
    expected = expected / expected.std()
    assert torch.allclose(out, expected, atol=1e-6)
    assert out.std().item() == pytest.approx(1.0, abs=1e-5)


def test_ip_noise_gamma_perturbs_input_only():
    noise = torch.randn(SHAPE, generator=gen(0))
    assert perturb_for_input(noise, NoiseOptions(), gen(1)) is noise
    out = perturb_for_input(noise, NoiseOptions(ip_noise_gamma=0.1), gen(17))
    assert torch.equal(out, noise + 0.1 * torch.randn(SHAPE, generator=gen(17)))
    out = perturb_for_input(noise, NoiseOptions(ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True), gen(19))
    g = gen(19)
    gamma = torch.rand(1, generator=g) * 0.1
    assert torch.equal(out, noise + gamma * torch.randn(SHAPE, generator=g))


def test_generator_replays_and_global_rng_untouched():
    latents = torch.zeros(SHAPE)
    opts = NoiseOptions(noise_offset=0.05, noise_offset_random_strength=True, multires_noise_iterations=4,
                        ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True)
    g = gen(21)
    state = g.get_state()
    torch.manual_seed(99)
    first = perturb_for_input(make_noise(latents, opts, g), opts, g)
    after_global = torch.rand(3)
    g.set_state(state)
    again = perturb_for_input(make_noise(latents, opts, g), opts, g)
    assert torch.equal(first, again)
    torch.manual_seed(99)
    assert torch.equal(torch.rand(3), after_global)  # the noise drew nothing from the global RNG


def test_noise_keeps_latent_dtype():
    latents = torch.zeros(SHAPE, dtype=torch.bfloat16)
    assert make_noise(latents, NoiseOptions(noise_offset=0.1, multires_noise_iterations=2), gen(0)).dtype == torch.bfloat16


# --- flags ---------------------------------------------------------------------------

import argparse  # noqa: E402

from library.cli.noise_loss import add_noise_loss_arguments, noise_options_from_args  # noqa: E402
from library.cli.ranges import check_ranges  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser()
    add_noise_loss_arguments(parser)
    return parser.parse_args(argv)


def test_noise_flag_defaults():
    assert noise_options_from_args(parse([])) == NoiseOptions()
    assert parse([]).zero_terminal_snr is False


def test_noise_flags_parse():
    ns = parse(["--noise_offset", "0.1", "--adaptive_noise_scale", "0.05", "--multires_noise_iterations", "6",
                "--ip_noise_gamma", "0.1", "--ip_noise_gamma_random_strength", "--min_timestep", "100",
                "--max_timestep", "900", "--zero_terminal_snr"])
    assert noise_options_from_args(ns) == NoiseOptions(
        noise_offset=0.1, adaptive_noise_scale=0.05, multires_noise_iterations=6, multires_noise_discount=0.3,
        ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True, min_timestep=100, max_timestep=900)
    assert ns.zero_terminal_snr is True


@pytest.mark.parametrize("argv, message", [
    (["--adaptive_noise_scale", "0.1"], "^--adaptive_noise_scale: needs --noise_offset$"),
    (["--noise_offset_random_strength"], "--noise_offset_random_strength: needs --noise_offset"),
    (["--ip_noise_gamma_random_strength"], "--ip_noise_gamma_random_strength: needs --ip_noise_gamma"),
    (["--min_timestep", "600", "--max_timestep", "500"], r"--min_timestep \(600\) is above --max_timestep \(500\)"),
    (["--max_timestep", "1001"], "--max_timestep: expected an integer from 0 to 1000, got 1001"),
])
def test_bad_noise_flags(argv, message):
    with pytest.raises(ConfigError, match=message):
        noise_options_from_args(parse(argv))


@pytest.mark.parametrize("argv, message", [
    (["--multires_noise_iterations", "0"], "^--multires_noise_iterations 0: expected an integer >= 1$"),
    (["--multires_noise_discount", "1.5"], r"^--multires_noise_discount 1.5: expected a number in \(0, 1\]$"),
    (["--noise_offset", "-0.1"], "^--noise_offset -0.1: expected a number >= 0$"),
    (["--max_timestep", "1001"], r"^--max_timestep 1001: expected an integer in \[0, 1000\]$"),
])
def test_noise_flag_ranges(argv, message):
    """Each flag's own range is declared with it and checked before any settings are built (check_ranges)."""
    with pytest.raises(ConfigError, match=message):
        check_ranges(vars(parse(argv)))
