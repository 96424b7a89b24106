"""Rectified-flow scheme (library/objectives/flow.py) and its flags: golden values."""

import math

import pytest
import torch

from library.core.errors import ConfigError
from library.objectives.flow import (
    FlowMatchScheme,
    FlowOptions,
    density_samples,
    flux_shift_mu,
    loss_weighting,
    shift_sigmas,
    time_shift,
)
from library.objectives.losses import LossOptions, check_loss_options, huber_c_for


def sigmas(**kw):
    scheme = FlowMatchScheme(FlowOptions(**kw))
    return [round(x, 4) for x in scheme.sample_sigmas(4, torch.Generator().manual_seed(0), (1, 16, 64, 64)).tolist()]


def test_timestep_sampling_golden_values():
    assert sigmas(timestep_sampling="uniform") == [0.4963, 0.7682, 0.0885, 0.132]  # torch.rand, seed 0
    assert sigmas(timestep_sampling="sigmoid") == [0.8236, 0.4272, 0.1017, 0.6384]
    assert sigmas(timestep_sampling="shift") == [0.9334, 0.6911, 0.2535, 0.8412]  # sigmoid shifted by 3
    assert sigmas(timestep_sampling="flux_shift") == [0.8976, 0.5834, 0.1753, 0.7682]  # 1024 tokens
    assert sigmas() == [0.753, 0.4754, 0.9688, 0.9518]  # "sigma" + uniform on the shift-3 schedule
    assert sigmas(weighting_scheme="logit_normal") == [0.3922, 0.801, 0.9639, 0.6299]
    assert sigmas(weighting_scheme="mode") == [0.75, 0.838, 0.3938, 0.4973]


def test_shift_formulas():
    assert shift_sigmas(torch.tensor([0.0, 0.5, 1.0]), 3.0).tolist() == [0.0, 0.75, 1.0]
    assert flux_shift_mu(256) == pytest.approx(0.5) and flux_shift_mu(4096) == pytest.approx(1.15)
    assert float(time_shift(0.5, torch.tensor(0.5))) == pytest.approx(math.exp(0.5) / (math.exp(0.5) + 1))
    # flux_shift of the same draws as "sigmoid", at 32x32 patches (1024 tokens)
    mu = flux_shift_mu(1024)
    draws = torch.tensor([0.8236, 0.4272])
    assert time_shift(mu, draws).tolist() == pytest.approx([0.8976, 0.5834], abs=1e-4)


def test_schedule_equals_diffusers_flow_match_euler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    ours = FlowMatchScheme(FlowOptions(discrete_flow_shift=3.0)).schedule_sigmas()
    ref = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).sigmas.float()
    assert ours.shape == (1000,) and torch.equal(ours, ref)


def test_density_and_weighting():
    g = torch.Generator().manual_seed(0)
    assert density_samples("uniform", 2, g).tolist() == pytest.approx([0.4963, 0.7682], abs=1e-4)
    # mode (SD3 paper, eq. 20): f(u) = 1 - u - s·(cos²(πu/2) - 1 + u) of the same uniform draws as "uniform"
    u = density_samples("uniform", 3, torch.Generator().manual_seed(0)).tolist()
    assert u == pytest.approx([0.4963, 0.7682, 0.0885], abs=1e-4)

    def mode(scale=None):
        kw = {} if scale is None else {"mode_scale": scale}
        return density_samples("mode", 3, torch.Generator().manual_seed(0), **kw).tolist()

    assert mode() == pytest.approx([0.5010, 0.3672, 0.8221], abs=1e-4)  # golden, default scale 1.29
    assert mode(0.0) == pytest.approx([1 - x for x in u], abs=1e-6)  # scale 0: plain 1 - u
    for scale in (1.29, 3.0):
        expected = [1 - x - scale * (math.cos(math.pi * x / 2) ** 2 - 1 + x) for x in u]
        assert mode(scale) == pytest.approx(expected, abs=1e-6)
    s = torch.tensor([0.5, 0.25])
    assert loss_weighting("sigma_sqrt", s).tolist() == [4.0, 16.0]
    assert loss_weighting("cosmap", s).tolist() == pytest.approx([2 / (math.pi * 0.5), 2 / (math.pi * 0.625)])
    assert loss_weighting("logit_normal", s).tolist() == [1.0, 1.0]


def test_forward_process_target_and_prediction_types():
    x0 = torch.full((2, 1, 1, 1), 2.0)
    eps = torch.full((2, 1, 1, 1), -1.0)
    t = torch.tensor([250.0, 750.0])
    scheme = FlowMatchScheme()
    xt = scheme.add_noise(x0, eps, t)
    assert xt.flatten().tolist() == [1.25, -0.25]  # (1-σ)·2 + σ·(-1)
    assert scheme.target(x0, eps, t).flatten().tolist() == [-3.0, -3.0]  # ε - x0
    out = torch.full((2, 1, 1, 1), 4.0)
    assert scheme.prediction(out, xt, t).flatten().tolist() == [4.0, 4.0]
    additive = FlowMatchScheme(FlowOptions(model_prediction_type="additive"))
    assert additive.prediction(out, xt, t).flatten().tolist() == [5.25, 3.75]
    scaled = FlowMatchScheme(FlowOptions(model_prediction_type="sigma_scaled", weighting_scheme="sigma_sqrt"))
    assert scaled.prediction(out, xt, t).flatten().tolist() == [0.25, -3.25]  # x_t - σ·out
    assert scaled.loss_weights(t).tolist() == pytest.approx([16.0, 1 / 0.5625])
    assert scheme.loss_weights(t).tolist() == [1.0, 1.0]  # raw: no weighting, as sd-scripts
    assert scheme.sample_timesteps(3, generator=torch.Generator().manual_seed(1)).dtype == torch.float32


def test_loss_options_with_flow():
    scheme = FlowMatchScheme()
    check_loss_options(LossOptions(loss_type="huber", huber_schedule="snr"), scheme)  # sd-scripts crashes here
    c = huber_c_for(torch.tensor([0.0, 500.0]), scheme, LossOptions(loss_type="huber"))
    assert c.tolist() == pytest.approx([1.0, 0.1 + 0.9 / 4])  # σ/(1-σ) = 0 and 1
    with pytest.raises(ConfigError, match="--min_snr_gamma"):
        check_loss_options(LossOptions(min_snr_gamma=5.0), scheme)
    assert scheme.validation_timesteps == (200, 400, 600, 800)

