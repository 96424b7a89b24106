"""Loss types, huber schedules, SNR weights and their order, against hand-computed numbers."""

import math

import pytest
import torch

from library.core.errors import ConfigError
from library.objectives.losses import (
    LossOptions,
    check_loss_options,
    elementwise_loss,
    huber_c_for,
    training_loss,
)
from library.objectives.noise import DDPMScheme

T3 = torch.tensor([0, 500, 999])
# float64 references of the SD scaled-linear schedule at t = 0, 500, 999
AC = [0.99915, 0.2763326838229746, 0.004660098513077234]
SNR = [a / (1 - a) for a in AC]  # 1175.47, 0.38185, 0.0046819
SIGMA = [math.sqrt((1 - a) / a) for a in AC]


class FlowLikeScheme:
    """Stands in for a rectified-flow scheme: no SNR, no sigmas."""

    prediction_type = "flow"
    has_snr = False
    num_train_timesteps = 1000


def pred_1234():
    return torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 2, 2)


def test_l2_and_l1():
    pred, target = pred_1234(), torch.zeros(1, 1, 2, 2)
    assert elementwise_loss(pred, target, "l2").flatten().tolist() == [1.0, 4.0, 9.0, 16.0]
    assert elementwise_loss(pred, target, "l1").flatten().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_huber_and_smooth_l1():
    pred, target = pred_1234(), torch.zeros(1, 1, 2, 2)
    huber = elementwise_loss(pred, target, "huber", torch.tensor([0.5])).flatten().tolist()
    assert huber == pytest.approx([0.618034, 1.561553, 2.541381, 3.531129], abs=1e-6)
    smooth = elementwise_loss(pred, target, "smooth_l1", 0.5).flatten().tolist()
    assert smooth == pytest.approx([1.236068, 3.123106, 5.082763, 7.062258], abs=1e-6)


def test_huber_c_is_per_sample():
    pred = torch.ones(2, 1, 1, 1) * 3.0
    out = elementwise_loss(pred, torch.zeros_like(pred), "huber", torch.tensor([0.5, 4.0])).flatten().tolist()
    assert out == pytest.approx([2 * 0.5 * (math.sqrt(9.25) - 0.5), 2 * 4.0 * (5.0 - 4.0)], abs=1e-5)


def test_huber_c_schedules():
    scheme = DDPMScheme()
    snr = huber_c_for(T3, scheme, LossOptions(loss_type="huber", huber_schedule="snr", huber_c=0.1, huber_scale=2.0))
    assert snr.tolist() == pytest.approx([0.9497099, 0.2312837, 0.1036913], abs=1e-5)  # scale not used by snr
    exp = huber_c_for(T3, scheme, LossOptions(loss_type="huber", huber_schedule="exponential", huber_c=0.1, huber_scale=2.0))
    assert exp.tolist() == pytest.approx([2.0, 0.6324555, 0.2004610], abs=1e-6)
    const = huber_c_for(T3, scheme, LossOptions(loss_type="huber", huber_schedule="constant", huber_c=0.1, huber_scale=2.0))
    assert const.tolist() == pytest.approx([0.2, 0.2, 0.2])


def test_plain_l2_training_loss_and_loss_weights():
    pred = torch.stack([torch.full((1, 2, 2), 1.0), torch.full((1, 2, 2), 2.0)])
    loss, per_sample = training_loss(pred, torch.zeros_like(pred), T3[:2], DDPMScheme(), LossOptions(),
                                     loss_weights=torch.tensor([1.0, 0.5]))
    assert per_sample.tolist() == [1.0, 2.0]
    assert loss.item() == 1.5


def test_mask_is_area_resized_not_normalised():
    pred = torch.ones(2, 1, 4, 4)
    mask = torch.zeros(2, 1, 8, 8)
    mask[0, :, :, :4] = 1.0  # left half -> left two latent columns
    mask[1, :, :, 0] = 1.0  # one image column -> half of one latent column
    _, per_sample = training_loss(pred, torch.zeros_like(pred), T3[:2], DDPMScheme(), LossOptions(), mask=mask)
    assert per_sample.tolist() == [0.5, 0.125]
    _, per_sample = training_loss(pred, torch.zeros_like(pred), T3[:2], DDPMScheme(), LossOptions(), mask=mask[:, 0])
    assert per_sample.tolist() == [0.5, 0.125]  # (B, H, W) alpha masks too


def unit_loss(options, scheme, timesteps=T3):
    pred = torch.ones(len(timesteps), 1, 2, 2)
    return training_loss(pred, torch.zeros_like(pred), timesteps, scheme, options)[1]


def test_min_snr_gamma_weights():
    eps = unit_loss(LossOptions(min_snr_gamma=5.0), DDPMScheme())
    assert eps.tolist() == pytest.approx([5 / SNR[0], 1.0, 1.0], rel=1e-4)
    v = unit_loss(LossOptions(min_snr_gamma=5.0), DDPMScheme("v_prediction"))
    assert v.tolist() == pytest.approx([5 / (SNR[0] + 1), SNR[1] / (SNR[1] + 1), SNR[2] / (SNR[2] + 1)], rel=1e-4)


def test_scale_v_pred_loss_like_noise_pred_caps_snr_at_1000():
    v = unit_loss(LossOptions(scale_v_pred_loss_like_noise_pred=True), DDPMScheme("v_prediction"))
    assert v.tolist() == pytest.approx([1000 / 1001, AC[1], AC[2]], rel=1e-4)


def test_v_pred_like_loss():
    out = unit_loss(LossOptions(v_pred_like_loss=0.2), DDPMScheme())
    assert out.tolist() == pytest.approx([1 + 0.2 * 1001 / 1000, 1 + 0.2 / AC[1], 1 + 0.2 / AC[2]], rel=1e-4)


def test_debiased_estimation():
    eps = unit_loss(LossOptions(debiased_estimation_loss=True), DDPMScheme())
    assert eps.tolist() == pytest.approx([1 / math.sqrt(1000), SIGMA[1], SIGMA[2]], rel=1e-4)
    v = unit_loss(LossOptions(debiased_estimation_loss=True), DDPMScheme("v_prediction"))
    assert v.tolist() == pytest.approx([1 / 1001, 1 - AC[1], 1 - AC[2]], rel=1e-4)


def test_terms_apply_in_sd_scripts_order():
    # eps: weight -> min_snr -> v_pred_like (adds loss/scale*k) -> debiased
    out = training_loss(torch.full((3, 1, 2, 2), 2.0), torch.zeros(3, 1, 2, 2), T3, DDPMScheme(),
                        LossOptions(min_snr_gamma=5.0, v_pred_like_loss=0.5, debiased_estimation_loss=True),
                        loss_weights=torch.tensor([1.0, 0.5, 2.0]))[1]
    expected = []
    for i, w in enumerate([1.0, 0.5, 2.0]):
        x = 4.0 * w * min(SNR[i], 5.0) / SNR[i]
        s = min(SNR[i], 1000.0)
        x = x + x / (s / (s + 1)) * 0.5
        expected.append(x / math.sqrt(s))
    assert out.tolist() == pytest.approx(expected, rel=1e-4)


def test_zero_terminal_snr_weights_are_finite():
    scheme = DDPMScheme("v_prediction", zero_terminal_snr=True)
    opts = LossOptions(min_snr_gamma=5.0, scale_v_pred_loss_like_noise_pred=True, debiased_estimation_loss=True)
    out = unit_loss(opts, scheme, torch.tensor([999, 999]))
    assert torch.isfinite(out).all()
    assert out.tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    eps = unit_loss(LossOptions(min_snr_gamma=5.0), DDPMScheme(zero_terminal_snr=True), torch.tensor([999]))
    assert eps.tolist() == pytest.approx([1.0])  # the limit of min(SNR, g) / SNR as SNR -> 0


def test_huber_loss_through_training_loss():
    pred = torch.full((1, 1, 2, 2), 3.0)
    opts = LossOptions(loss_type="huber", huber_schedule="constant", huber_c=0.5)
    loss, _ = training_loss(pred, torch.zeros_like(pred), torch.tensor([10]), DDPMScheme(), opts)
    assert loss.item() == pytest.approx(2 * 0.5 * (math.sqrt(9.25) - 0.5), abs=1e-6)


def test_check_loss_options():
    eps, v, flow = DDPMScheme(), DDPMScheme("v_prediction"), FlowLikeScheme()
    check_loss_options(LossOptions(min_snr_gamma=5, debiased_estimation_loss=True), eps)
    check_loss_options(LossOptions(loss_type="huber", huber_schedule="exponential"), flow)
    check_loss_options(LossOptions(loss_type="huber"), eps)
    cases = [
        (LossOptions(min_snr_gamma=5), flow, "--min_snr_gamma: needs an SNR-based"),
        (LossOptions(debiased_estimation_loss=True), flow, "--debiased_estimation_loss"),
        (LossOptions(loss_type="huber", huber_schedule="snr"), flow, "--huber_schedule snr"),
        (LossOptions(scale_v_pred_loss_like_noise_pred=True), eps, "only valid with --v_parameterization"),
        (LossOptions(v_pred_like_loss=0.1), v, "not valid with --v_parameterization"),
        (LossOptions(loss_type="l3"), eps, "--loss_type: expected one of l2, l1, huber, smooth_l1"),
        (LossOptions(min_snr_gamma=-1), eps, "--min_snr_gamma: expected a number > 0"),
    ]
    for options, scheme, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            check_loss_options(options, scheme)


# --- flags ---------------------------------------------------------------------------

import argparse  # noqa: E402

from library.cli.noise_loss import add_noise_loss_arguments, loss_options_from_args  # noqa: E402
from library.cli.ranges import check_ranges  # noqa: E402


def parse(argv):
    parser = argparse.ArgumentParser()
    add_noise_loss_arguments(parser)
    return parser.parse_args(argv)


def test_loss_flag_defaults():
    assert loss_options_from_args(parse([])) == LossOptions()


def test_loss_flags_parse():
    ns = parse(["--loss_type", "smooth_l1", "--huber_schedule", "exponential", "--huber_c", "0.2", "--huber_scale", "2",
                "--min_snr_gamma", "5", "--v_pred_like_loss", "0.1", "--debiased_estimation_loss"])
    ns.masked_loss = True  # defined by the dataset flags
    assert loss_options_from_args(ns) == LossOptions(
        loss_type="smooth_l1", huber_schedule="exponential", huber_c=0.2, huber_scale=2.0, min_snr_gamma=5.0,
        v_pred_like_loss=0.1, debiased_estimation_loss=True, masked_loss=True)


@pytest.mark.parametrize("argv, message", [
    (["--huber_c", "0"], "^--huber_c 0: expected a number > 0$"),
    (["--min_snr_gamma", "-5"], "^--min_snr_gamma -5: expected a number > 0$"),
    (["--huber_scale", "0"], "^--huber_scale 0: expected a number > 0$"),
])
def test_bad_loss_flags(argv, message):
    """Each flag's own range is declared with it (library/cli/noise_loss.py) and checked before any settings are
    built (check_ranges, the first step of settings_from_args)."""
    with pytest.raises(ConfigError, match=message):
        check_ranges(vars(parse(argv)))


def test_loss_type_choices():
    with pytest.raises(SystemExit):
        parse(["--loss_type", "l3"])
