"""Timestep bias, DDPM schedule overrides, --prediction_type, soft min-SNR and --scale_lr: exact values."""

import argparse
import math

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from library.cli.model import add_model_arguments, load_options_from_args
from library.cli.noise_loss import (
    add_noise_loss_arguments,
    loss_options_from_args,
    noise_options_from_args,
    noise_schedule_from_args,
    prediction_type_from_args,
    read_scheduler_overrides,
)
from library.cli.optimizer import add_optimizer_arguments, optimizer_options_from_args
from library.cli.ranges import check_ranges
from library.core.errors import ConfigError
from library.families import get_family
from library.families.base import LoadOptions
from library.families.sd.generate import SD_SCHEDULER_CONFIG
from library.objectives.flow import FlowMatchScheme, FlowOptions
from library.objectives.losses import LossOptions, check_loss_options, soft_min_snr_weight, training_loss
from library.objectives.noise import DDPMSchedule, DDPMScheme
from library.objectives.timestep_bias import TimestepBias

N = 200_000


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def share(timesteps, lo, hi):
    t = timesteps.double()
    return ((t >= lo) & (t < hi)).double().mean().item()


def biased_share(q, m):
    """Mass of a region holding base mass q after its density is multiplied by m."""
    return m * q / (m * q + (1 - q))


# --- timestep bias: DDPM ------------------------------------------------------------------

@pytest.mark.parametrize("bias, lo, hi, region, expected", [
    (TimestepBias("later", 2.0), None, None, (750, 1000), 500 / 1250),        # 0.4
    (TimestepBias("earlier", 0.5), None, None, (0, 250), 125 / 875),          # 1/7
    (TimestepBias("range", 3.0, 200, 500), None, None, (200, 500), 900 / 1600),  # 0.5625
    (TimestepBias("later", 2.0), 500, 1000, (750, 1000), 500 / 750),          # 2/3 of the allowed range
    (TimestepBias("later", 4.0, portion=0.1), 0, 1000, (900, 1000), 400 / 1300),
])
def test_ddpm_bias_shares(bias, lo, hi, region, expected):
    t = DDPMScheme().sample_timesteps(N, lo, hi, generator=gen(), bias=bias)
    assert t.dtype == torch.long and t.shape == (N,)
    assert t.min().item() >= (lo or 0) and t.max().item() < (hi or 1000)
    assert share(t, *region) == pytest.approx(expected, abs=0.004)
    # inside and outside the region the draw stays uniform: both halves of the region get half its mass
    mid = (region[0] + region[1]) // 2
    assert share(t, region[0], mid) == pytest.approx(expected / 2, abs=0.004)


def test_ddpm_bias_exact_distribution():
    """The inverse-CDF law is exactly w(t)/sum(w): checked on a tiny range where every atom is visible."""
    bias = TimestepBias("range", 3.0, 2, 3)
    t = DDPMScheme().sample_timesteps(N, 0, 4, generator=gen(1), bias=bias)
    counts = torch.bincount(t, minlength=4).double() / N
    assert torch.allclose(counts, torch.tensor([1, 1, 3, 1], dtype=torch.float64) / 6, atol=0.004)


@pytest.mark.parametrize("bias", [None, TimestepBias(), TimestepBias("later", 1.0), TimestepBias("none", 3.0)])
def test_ddpm_inactive_bias_is_bit_identical(bias):
    g_ref, g = gen(7), gen(7)
    ref = DDPMScheme().sample_timesteps(64, 10, 900, generator=g_ref)
    out = DDPMScheme().sample_timesteps(64, 10, 900, generator=g, bias=bias)
    assert torch.equal(ref, out)
    assert torch.equal(g_ref.get_state(), g.get_state())


def test_ddpm_bias_draws_one_float64_per_sample_and_replays():
    g, g_ref = gen(3), gen(3)
    a = DDPMScheme().sample_timesteps(16, generator=g, bias=TimestepBias("later", 2.0))
    torch.rand((16,), generator=g_ref, dtype=torch.float64)
    assert torch.equal(g.get_state(), g_ref.get_state())
    b = DDPMScheme().sample_timesteps(16, generator=gen(3), bias=TimestepBias("later", 2.0))
    assert torch.equal(a, b)


def test_bias_weights_and_regions():
    t = torch.tensor([0, 249, 250, 749, 750, 999, 1000.0])
    assert TimestepBias("later", 2.0).weights(t).tolist() == [1, 1, 1, 1, 2, 2, 2]
    assert TimestepBias("earlier", 0.5).weights(t).tolist() == [0.5, 0.5, 1, 1, 1, 1, 1]
    assert TimestepBias("range", 3.0, 249, 750).weights(t).tolist() == [1, 3, 3, 3, 1, 1, 1]
    assert TimestepBias("later", 2.0, portion=0.3).region() == (700.0, math.inf)


# --- timestep bias: flow matching ---------------------------------------------------------

def _normal_cdf(x):
    return 0.5 * math.erfc(-x / math.sqrt(2))


def test_flow_bias_uniform_sampling():
    scheme = FlowMatchScheme(FlowOptions(timestep_sampling="uniform"))
    t = scheme.sample_timesteps(N, generator=gen(), bias=TimestepBias("later", 2.0))
    assert t.dtype == torch.float32 and t.shape == (N,)
    assert share(t, 750, math.inf) == pytest.approx(biased_share(0.25, 2.0), abs=0.004)  # 0.4


def test_flow_bias_sigmoid_sampling():
    # σ = sigmoid(Z): P(σ < 0.25) = Φ(logit 0.25) = Φ(-ln 3)
    scheme = FlowMatchScheme(FlowOptions(timestep_sampling="sigmoid"))
    q = _normal_cdf(-math.log(3))
    t = scheme.sample_timesteps(N, generator=gen(), bias=TimestepBias("earlier", 3.0))
    assert share(t, -math.inf, 250) == pytest.approx(biased_share(q, 3.0), abs=0.004)
    t0 = scheme.sample_timesteps(N, generator=gen())
    assert share(t0, -math.inf, 250) == pytest.approx(q, abs=0.004)


def test_flow_bias_sigma_sampling_on_shifted_schedule():
    # --timestep_sampling sigma (uniform weighting): σ uniform over the 1000 shifted schedule values
    scheme = FlowMatchScheme(FlowOptions(timestep_sampling="sigma", discrete_flow_shift=3.0))
    q = (scheme.schedule_sigmas() * 1000 >= 750).double().mean().item()
    t = scheme.sample_timesteps(N, generator=gen(), bias=TimestepBias("later", 2.0))
    assert share(t, 750, math.inf) == pytest.approx(biased_share(q, 2.0), abs=0.004)
    t = scheme.sample_timesteps(N, generator=gen(), bias=TimestepBias("later", 0.25))
    assert share(t, 750, math.inf) == pytest.approx(biased_share(q, 0.25), abs=0.004)


@pytest.mark.parametrize("bias", [None, TimestepBias(), TimestepBias("range", 1.0, 0, 10)])
def test_flow_inactive_bias_is_bit_identical(bias):
    scheme = FlowMatchScheme(FlowOptions(timestep_sampling="shift"))
    g_ref, g = gen(5), gen(5)
    ref = scheme.sample_timesteps(32, generator=g_ref)
    out = scheme.sample_timesteps(32, generator=g, bias=bias)
    assert torch.equal(ref, out) and torch.equal(g_ref.get_state(), g.get_state())


def test_flow_bias_replays_from_the_generator():
    scheme = FlowMatchScheme(FlowOptions(timestep_sampling="flux_shift"))
    a = scheme.sample_timesteps(8, generator=gen(9), latent_shape=(1, 16, 64, 64), bias=TimestepBias("later", 5.0))
    b = scheme.sample_timesteps(8, generator=gen(9), latent_shape=(1, 16, 64, 64), bias=TimestepBias("later", 5.0))
    assert torch.equal(a, b)


# --- flags ------------------------------------------------------------------------------------

def parse(argv, optimizer=False, model=False):
    parser = argparse.ArgumentParser()
    add_noise_loss_arguments(parser)
    if optimizer:
        add_optimizer_arguments(parser)
        parser.add_argument("--train_batch_size", type=int, default=1)
        parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
        parser.add_argument("--unet_lr", type=float, default=None)
    if model:
        add_model_arguments(parser)
    return parser.parse_args(argv)


def test_bias_flags():
    opts = noise_options_from_args(parse(["--timestep_bias_strategy", "range", "--timestep_bias_begin", "100",
                                          "--timestep_bias_end", "300", "--timestep_bias_multiplier", "2.5"]))
    assert opts.timestep_bias == TimestepBias("range", 2.5, 100, 300, 0.25)
    assert noise_options_from_args(parse([])).timestep_bias is None


@pytest.mark.parametrize("argv, message", [
    (["--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "0"], "--timestep_bias_multiplier"),
    (["--timestep_bias_strategy", "later", "--timestep_bias_portion", "0"], "--timestep_bias_portion"),
    (["--timestep_bias_strategy", "later", "--timestep_bias_portion", "1.5"], "--timestep_bias_portion"),
    (["--timestep_bias_strategy", "later", "--timestep_bias_portion", "0.0001"], "less than one timestep"),
    (["--timestep_bias_strategy", "range", "--timestep_bias_begin", "10"], "needs --timestep_bias_begin"),
    (["--timestep_bias_strategy", "range", "--timestep_bias_begin", "500", "--timestep_bias_end", "500"],
     "0 <= begin < end <= 1000"),
    (["--timestep_bias_strategy", "range", "--timestep_bias_begin", "0", "--timestep_bias_end", "1001"],
     "0 <= begin < end <= 1000"),
    (["--timestep_bias_strategy", "later", "--timestep_bias_begin", "10"], "only used with"),
    (["--timestep_bias_multiplier", "2"], "needs --timestep_bias_strategy"),
])
def test_bad_bias_flags(argv, message):
    with pytest.raises(ConfigError, match=message) as e:
        noise_options_from_args(parse(argv))
    assert "\n" not in str(e.value)


def test_rescale_zero_terminal_snr_is_an_alias():
    assert parse(["--rescale_zero_terminal_snr"]).zero_terminal_snr is True
    assert parse([]).zero_terminal_snr is False


def test_prediction_type_is_v_parameterization():
    assert load_options_from_args(parse(["--pretrained_model_name_or_path", "x", "--prediction_type", "v_prediction"],
                                        model=True)).v_parameterization is True
    assert load_options_from_args(parse(["--pretrained_model_name_or_path", "x", "--v_parameterization"],
                                        model=True)).v_parameterization is True
    assert prediction_type_from_args(parse(["--prediction_type", "epsilon"], model=True)) == "epsilon"
    assert prediction_type_from_args(parse([], model=True)) is None
    with pytest.raises(ConfigError, match="--prediction_type epsilon conflicts with --v_parameterization"):
        prediction_type_from_args(parse(["--v_parameterization", "--prediction_type", "epsilon"], model=True))


def write(tmp_path, text, name="sched.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_scheduler_overrides_file(tmp_path):
    path = write(tmp_path, 'beta_schedule = "linear"\nbeta_start = 0.0001\nbeta_end = 0.02\nnum_train_timesteps = 500\n'
                           'rescale_betas_zero_snr = true\ntimestep_spacing = "trailing"\n')
    ns = parse(["--noise_scheduler_overrides", path], model=True)
    schedule = noise_schedule_from_args(ns)
    assert schedule == DDPMSchedule(500, 0.0001, 0.02, "linear", True, "trailing")
    scheme = DDPMScheme.from_schedule(schedule, "epsilon")
    ref = DDPMScheduler(num_train_timesteps=500, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                        rescale_betas_zero_snr=True)
    assert torch.equal(scheme.alphas_cumprod, ref.alphas_cumprod) and scheme.zero_terminal_snr
    assert scheme.validation_timesteps == (100, 200, 300, 400)
    assert DDPMScheme().validation_timesteps == (200, 400, 600, 800)
    # the timestep range follows the file's count
    with pytest.raises(ConfigError, match="--max_timestep: expected an integer from 0 to 500"):
        noise_options_from_args(parse(["--noise_scheduler_overrides", path, "--max_timestep", "600"]))
    # one [noise_scheduler] table works the same
    table = write(tmp_path, '[noise_scheduler]\nbeta_schedule = "squaredcos_cap_v2"\n', "t.toml")
    assert noise_schedule_from_args(parse(["--noise_scheduler_overrides", table])).beta_schedule == "squaredcos_cap_v2"


def test_cosine_betas_equal_diffusers():
    scheme = DDPMScheme(beta_schedule="squaredcos_cap_v2")
    assert torch.equal(scheme.betas, DDPMScheduler(beta_schedule="squaredcos_cap_v2").betas)


@pytest.mark.parametrize("text, message", [
    ("clip_sample = false\n", "unknown key 'clip_sample'"),
    ('beta_schedule = "sigmoid2"\n', "beta_schedule: expected one of scaled_linear, linear, squaredcos_cap_v2"),
    ('num_train_timesteps = "1000"\n', "num_train_timesteps = '1000' in .*: expected an integer$"),
    ("num_train_timesteps = true\n", "expected an integer$"),
    ('beta_end = "0.02"\n', "expected a number or an integer$"),
    ("rescale_betas_zero_snr = 1\n", "expected true or false$"),
    ("beta_start = 0.02\nbeta_end = 0.01\n", "beta_start \\(0.02\\) is above beta_end"),
    ('timestep_spacing = "uniform"\n', "timestep_spacing: expected one of leading, trailing, linspace"),
    ("beta_start = = 1\n", "not valid TOML"),
])
def test_bad_scheduler_overrides(tmp_path, text, message):
    ns = parse(["--noise_scheduler_overrides", write(tmp_path, text)], model=True)
    with pytest.raises(ConfigError, match=message) as e:
        noise_schedule_from_args(ns)
    assert "\n" not in str(e.value) and "--noise_scheduler_overrides" in str(e.value)


def test_scheduler_override_prediction_type(tmp_path):
    path = write(tmp_path, 'prediction_type = "v_prediction"\n')
    assert prediction_type_from_args(parse(["--noise_scheduler_overrides", path], model=True)) == "v_prediction"
    with pytest.raises(ConfigError, match="conflicts with --v_parameterization"):
        prediction_type_from_args(parse(["--noise_scheduler_overrides", write(tmp_path, 'prediction_type = "epsilon"\n'),
                                         "--v_parameterization"], model=True))
    with pytest.raises(ConfigError, match="prediction_type = 'sample'"):
        prediction_type_from_args(parse(["--noise_scheduler_overrides", write(tmp_path, 'prediction_type = "sample"\n')],
                                        model=True))


def test_timestep_spacing_is_for_sampling_only(tmp_path):
    schedule = noise_schedule_from_args(parse(["--timestep_spacing", "trailing"]))
    assert schedule == DDPMSchedule(timestep_spacing="trailing")
    # training is unchanged: same betas as the default scheme
    assert torch.equal(DDPMScheme.from_schedule(schedule).alphas_cumprod, DDPMScheme().alphas_cumprod)
    config = {**SD_SCHEDULER_CONFIG, **schedule.sampler_config()}
    sampler = DDIMScheduler.from_config(config)
    sampler.set_timesteps(4)
    assert sampler.timesteps.tolist() == [999, 749, 499, 249]  # trailing; leading would be 751, 501, 251, 1
    assert noise_schedule_from_args(parse([])) is None
    with pytest.raises(ConfigError, match="conflicts with timestep_spacing"):
        noise_schedule_from_args(parse(["--timestep_spacing", "leading", "--noise_scheduler_overrides",
                                        write(tmp_path, 'timestep_spacing = "trailing"\n')]))


def test_sd_family_uses_the_schedule():
    family = get_family("sd")

    class C:
        v_parameterization = True
        noise_schedule = DDPMSchedule(beta_schedule="linear", beta_start=0.0001, beta_end=0.02)

    scheme = family.noise_scheme(C(), zero_terminal_snr=True)
    ref = DDPMScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02, rescale_betas_zero_snr=True)
    assert scheme.v_prediction and torch.equal(scheme.alphas_cumprod, ref.alphas_cumprod)


def test_flux_refuses_ddpm_scheduler_flags():
    family = get_family("flux")
    opts = family.options_type()
    with pytest.raises(ConfigError, match="--v_parameterization / --prediction_type v_prediction"):
        family.check_options(opts, LoadOptions("", v_parameterization=True))
    with pytest.raises(ConfigError, match="--noise_scheduler_overrides / --timestep_spacing"):
        family.check_options(opts, LoadOptions("", noise_schedule=DDPMSchedule(timestep_spacing="trailing")))


# --- soft min-SNR ----------------------------------------------------------------------------

def test_soft_min_snr_exact_values():
    snr = torch.tensor([5.0, 1.0, 20.0], dtype=torch.float64)
    assert soft_min_snr_weight(snr, 5.0, False).tolist() == pytest.approx([0.5, 5 / 6, 0.2], rel=1e-15)
    assert soft_min_snr_weight(snr, 5.0, True).tolist() == pytest.approx([25 / 60, 5 / 12, 100 / 525], rel=1e-15)


@pytest.mark.parametrize("v_pred", [False, True])
def test_soft_min_snr_in_the_loss_at_known_timesteps(v_pred):
    scheme = DDPMScheme(prediction_type="v_prediction" if v_pred else "epsilon")
    timesteps = torch.tensor([0, 500, 999])
    ac = scheme.alphas_cumprod[timesteps].double()
    snr = ac / (1 - ac)
    assert snr[0].item() == pytest.approx(0.99915 / 0.00085, rel=1e-4)  # 1175.47 at t = 0 (float32 ac: 1175.44)
    gamma = 5.0
    expected = snr * gamma / ((snr + gamma) * (snr + 1)) if v_pred else gamma / (snr + gamma)
    pred = torch.zeros(3, 4, 2, 2)
    target = torch.ones(3, 4, 2, 2)  # l2 per sample = 1
    loss, per_sample = training_loss(pred, target, timesteps, scheme, LossOptions(soft_min_snr_gamma=gamma))
    assert per_sample.double() == pytest.approx(expected.tolist(), rel=1e-5)
    if not v_pred:
        assert per_sample[0].item() == pytest.approx(5 / (0.99915 / 0.00085 + 5), rel=1e-4)  # 0.0042356


def test_soft_min_snr_checks():
    with pytest.raises(ConfigError, match="set only one of them"):
        loss_options_from_args(parse(["--min_snr_gamma", "5", "--soft_min_snr_gamma", "5"]))
    with pytest.raises(ConfigError, match="^--soft_min_snr_gamma 0: expected a number > 0$"):
        check_ranges(vars(parse(["--soft_min_snr_gamma", "0"])))  # its declared range, checked before the settings
    assert loss_options_from_args(parse(["--soft_min_snr_gamma", "4"])).soft_min_snr_gamma == 4.0
    with pytest.raises(ConfigError, match="--soft_min_snr_gamma: needs an SNR-based"):
        check_loss_options(LossOptions(soft_min_snr_gamma=5.0), FlowMatchScheme())


# --- --scale_lr -------------------------------------------------------------------------------

def test_scale_lr(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    argv = ["--learning_rate", "1e-4", "--train_batch_size", "4", "--gradient_accumulation_steps", "2"]
    assert optimizer_options_from_args(parse(argv, optimizer=True)).learning_rate == 1e-4
    assert optimizer_options_from_args(parse(argv + ["--scale_lr"], optimizer=True)).learning_rate == 1e-4 * 24
    monkeypatch.delenv("WORLD_SIZE")
    assert optimizer_options_from_args(parse(argv + ["--scale_lr"], optimizer=True)).learning_rate == 1e-4 * 8
    with pytest.raises(ConfigError, match="--scale_lr: scales --learning_rate only, and --unet_lr"):
        optimizer_options_from_args(parse(argv + ["--scale_lr", "--unet_lr", "1e-4"], optimizer=True))


# --- end to end: a LoRA run with every knob, stopped and resumed -----------------------------

def test_run_with_knobs_resumes_bitwise_and_records_effective_lr(tmp_path, monkeypatch):
    import signal

    from safetensors import safe_open
    from safetensors.torch import load_file

    from library.train.trainer import InterruptedTraining
    from tests.train_helpers import base_args, make_dataset, make_trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = make_dataset(str(tmp_path), n=2)
    sched = write(tmp_path, 'beta_schedule = "linear"\nbeta_start = 0.0001\nbeta_end = 0.02\n')
    extra = ["--timestep_bias_strategy", "later", "--timestep_bias_multiplier", "3", "--soft_min_snr_gamma", "5",
             "--noise_scheduler_overrides", sched, "--prediction_type", "v_prediction", "--rescale_zero_terminal_snr",
             "--scale_lr", "--gradient_accumulation_steps", "2", "--learning_rate", "5e-4"]
    steps = 6
    seen = []
    original = DDPMScheme.sample_timesteps

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("bias"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DDPMScheme, "sample_timesteps", spy)
    straight_trainer = make_trainer(base_args(data, str(tmp_path / "a"), steps=steps, extra=extra))
    straight = straight_trainer.run()
    monkeypatch.setattr(DDPMScheme, "sample_timesteps", original)
    assert len(seen) == steps * 2 and all(b == TimestepBias("later", 3.0) for b in seen)  # the loop passes the bias
    scheme = straight_trainer.ctx.scheme
    assert scheme.beta_schedule == "linear" and scheme.v_prediction and scheme.zero_terminal_snr
    assert straight_trainer.s.noise.timestep_bias == TimestepBias("later", 3.0)
    assert straight_trainer.s.optimizer.learning_rate == pytest.approx(1e-3)  # 5e-4 x 1 process x batch 1 x 2
    with safe_open(straight, "pt") as f:
        assert float(f.metadata()["ss_learning_rate"]) == pytest.approx(1e-3)

    def stop_at(trainer, event, step):
        if event == "step" and step == 3:
            trainer._on_signal(signal.SIGTERM, None)

    out_b = str(tmp_path / "b")
    first = make_trainer(base_args(data, out_b, steps=steps, extra=extra))
    first.s.hooks.append(stop_at)
    with pytest.raises(InterruptedTraining):
        first.run()
    resumed = make_trainer(base_args(data, out_b, steps=steps, extra=extra + ["--resume", "auto"])).run()
    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_flux_lora_run_with_bias_and_scale_lr(tmp_path, monkeypatch):
    from tests.train_helpers import base_args, make_dataset, make_trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []
    original = FlowMatchScheme.sample_timesteps

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append((kwargs.get("bias"), out))
        return out

    monkeypatch.setattr(FlowMatchScheme, "sample_timesteps", spy)
    import signal

    from safetensors.torch import load_file

    from library.train.trainer import InterruptedTraining

    data = make_dataset(str(tmp_path), n=2)
    extra = ["--t5xxl_max_token_length", "8", "--network_train_unet_only", "--timestep_sampling", "sigmoid",
             "--timestep_bias_strategy", "range", "--timestep_bias_begin", "400", "--timestep_bias_end", "600",
             "--timestep_bias_multiplier", "4", "--scale_lr"]
    trainer = make_trainer(base_args(data, str(tmp_path / "a"), "tiny:flux", steps=4, extra=extra), "flux")
    straight = trainer.run()
    assert trainer.s.optimizer.learning_rate == pytest.approx(1e-3)  # 1e-3 x 1 x batch 1 x 1
    assert len(seen) == 4 and all(b == TimestepBias("range", 4.0, 400, 600) for b, _ in seen)

    # acceptance-rejection draws a varying number of values: a resumed run still replays them exactly
    def stop_at(trainer, event, step):
        if event == "step" and step == 2:
            trainer._on_signal(signal.SIGTERM, None)

    first = make_trainer(base_args(data, str(tmp_path / "b"), "tiny:flux", steps=4, extra=extra), "flux")
    first.s.hooks.append(stop_at)
    with pytest.raises(InterruptedTraining):
        first.run()
    resumed = make_trainer(base_args(data, str(tmp_path / "b"), "tiny:flux", steps=4,
                                     extra=extra + ["--resume", "auto"]), "flux").run()
    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(seen) == 8  # 4 straight, 2 before the stop, 2 after the resume: the same timesteps
    assert torch.equal(torch.cat([t for _, t in seen[:4]]), torch.cat([t for _, t in seen[4:]]))


@pytest.mark.parametrize("family_name", ["sd", "sdxl", "flux"])
@pytest.mark.parametrize("fine_tune", [False, True])
def test_every_training_script_takes_the_knobs(family_name, fine_tune):
    from library.cli.entry import build_parser

    parser = build_parser("", get_family(family_name), fine_tune)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--timestep_bias_strategy", "--timestep_bias_multiplier", "--timestep_bias_begin", "--timestep_bias_end",
            "--timestep_bias_portion", "--prediction_type", "--rescale_zero_terminal_snr", "--timestep_spacing",
            "--noise_scheduler_overrides", "--soft_min_snr_gamma", "--scale_lr"} <= flags
