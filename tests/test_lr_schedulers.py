"""LR schedules: golden values per scheduler, warmup forms, exact resume, adafactor, log names."""

import pytest
import torch

from library.core.errors import ConfigError
from library.train.optim.lr_schedulers import (
    SCHEDULERS,
    SchedulerOptions,
    create_scheduler,
    lr_log_names,
    lr_logs,
    parse_scheduler_args,
    parse_step_rules,
    resolve_steps,
)
from library.train.optim.optimizers import OptimizerOptions, create_optimizer

# these tests step schedulers without training, which torch warns about
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")

STEPS = [0, 5, 10, 55, 99, 100, 120]  # 100 total steps, warmup 10; 100 and 120 are past the end

# Values were cross-checked against transformers' / diffusers' schedules of the same name
# (they agree up to step 99; past the end ours stay at the final value instead of rising again).
GOLDEN = {
    "constant": (SchedulerOptions("constant"), [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    "constant_with_warmup": (SchedulerOptions("constant_with_warmup", 10), [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    "linear": (SchedulerOptions("linear", 10), [0.0, 0.5, 1.0, 0.5, 0.0111111, 0.0, 0.0]),
    "cosine": (SchedulerOptions("cosine", 10), [0.0, 0.5, 1.0, 0.5, 0.0003046, 0.0, 0.0]),
    "cosine_with_restarts": (SchedulerOptions("cosine_with_restarts", 10, lr_scheduler_num_cycles=3),
                             [0.0, 0.5, 1.0, 0.5, 0.0027391, 0.0, 0.0]),
    "cosine_with_restarts_floor": (
        SchedulerOptions("cosine_with_restarts", 10, lr_scheduler_num_cycles=3, lr_scheduler_min_lr_ratio=0.1),
        [0.0, 0.5, 1.0, 0.55, 0.1024651, 0.1, 0.1]),
    "cosine_with_min_lr": (SchedulerOptions("cosine_with_min_lr", 10, lr_scheduler_min_lr_ratio=0.1),
                           [0.0, 0.5, 1.0, 0.55, 0.1002741, 0.1, 0.1]),
    "polynomial": (SchedulerOptions("polynomial", 10, lr_scheduler_power=2.0),
                   [0.0, 0.5, 1.0, 0.2500001, 0.0001236, 1e-07, 1e-07]),
    "inverse_sqrt": (SchedulerOptions("inverse_sqrt", 10), [0.0, 0.5, 1.0, 0.4264014, 0.3178209, 0.3162278, 0.2886751]),
    "warmup_stable_decay": (
        SchedulerOptions("warmup_stable_decay", 10, lr_decay_steps=30, lr_scheduler_min_lr_ratio=0.1),
        [0.1, 0.55, 1.0, 1.0, 0.1024651, 0.1, 0.1]),
    "rex": (SchedulerOptions("rex", 10), [0.0, 0.5, 1.0, 2 / 3, 0.021978, 0.0, 0.0]),
    "rex_floor": (SchedulerOptions("rex", 10, lr_scheduler_min_lr_ratio=0.1), [0.0, 0.5, 1.0, 0.7, 0.1197802, 0.1, 0.1]),
}


def sgd(lr=1.0, groups=1):
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for _ in range(groups)], lr=lr)


def lrs_at(scheduler, steps):
    out = {}
    for i in range(max(steps) + 1):
        if i in steps:
            out[i] = scheduler.get_last_lr()[0]
        scheduler.step()
    return [out[i] for i in steps]


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_golden_values(case):
    options, expected = GOLDEN[case]
    assert lrs_at(create_scheduler(sgd(), options, 100), STEPS) == pytest.approx(expected, abs=1e-7)


def test_piecewise_constant():
    options = SchedulerOptions("piecewise_constant", lr_scheduler_args=parse_scheduler_args(["step_rules=1:10,0.1:20,0.01"]))
    assert lrs_at(create_scheduler(sgd(), options, 100), [0, 9, 10, 19, 20, 99]) == [1.0, 1.0, 0.1, 0.1, 0.01, 0.01]
    assert parse_step_rules("1:10,0.1:20,0.01") == ([(10, 1.0), (20, 0.1)], 0.01)
    with pytest.raises(ConfigError, match="step_rules"):
        parse_step_rules("1-10,0.1")


def test_every_scheduler_has_a_golden_test():
    covered = {options.lr_scheduler for options, _ in GOLDEN.values()} | {"piecewise_constant", "adafactor"}
    assert covered == set(SCHEDULERS)


def test_schedule_scales_each_group_lr():
    opt = sgd(groups=2)
    opt.param_groups[1]["lr"] = 0.5
    sched = create_scheduler(opt, SchedulerOptions("cosine", 10), 100)
    for _ in range(55):
        sched.step()
    assert sched.get_last_lr() == pytest.approx([0.5, 0.25])


@pytest.mark.parametrize("value, expected", [(10, 10), ("10", 10), (0.1, 20), ("0.1", 20), ("5%", 10), ("12.5%", 25),
                                             (None, 0), ("0", 0), (30.0, 30)])
def test_resolve_steps(value, expected):
    assert resolve_steps(value, 200) == expected


@pytest.mark.parametrize("value", ["ten", "-5", -1, "150%", 2.5, True])
def test_resolve_steps_rejects(value):
    with pytest.raises(ConfigError, match="--lr_warmup_steps: expected a"):
        resolve_steps(value, 200)


def test_warmup_forms_give_the_same_schedule():
    by_count = lrs_at(create_scheduler(sgd(), SchedulerOptions("linear", 10), 100), list(range(0, 100, 7)))
    by_ratio = lrs_at(create_scheduler(sgd(), SchedulerOptions("linear", 0.1), 100), list(range(0, 100, 7)))
    by_pct = lrs_at(create_scheduler(sgd(), SchedulerOptions("linear", "10%"), 100), list(range(0, 100, 7)))
    assert by_count == by_ratio == by_pct


RESUME_CASES = [GOLDEN[name][0] for name in sorted(GOLDEN)] + [
    SchedulerOptions("piecewise_constant", lr_scheduler_args={"step_rules": "1:10,0.1:40,0.01"})]


@pytest.mark.parametrize("options", RESUME_CASES, ids=lambda o: o.lr_scheduler)
def test_resume_is_exact(options):
    total, stop = 100, 37
    first_opt = sgd(groups=2)
    first = create_scheduler(first_opt, options, total)
    for _ in range(stop):
        first_opt.step()
        first.step()
    saved_sched, saved_opt = first.state_dict(), first_opt.state_dict()
    expected = []
    for _ in range(50):
        first.step()
        expected.append([g["lr"] for g in first_opt.param_groups])

    second_opt = sgd(groups=2)
    second = create_scheduler(second_opt, options, total)
    second_opt.load_state_dict(saved_opt)
    second.load_state_dict(saved_sched)
    got = []
    for _ in range(50):
        second.step()
        got.append([g["lr"] for g in second_opt.param_groups])
    assert got == expected


def test_warmup_with_a_scheduler_without_warmup_is_an_error():
    with pytest.raises(ConfigError, match="--lr_warmup_steps: --lr_scheduler constant has no warmup; use constant_with_warmup"):
        create_scheduler(sgd(), SchedulerOptions("constant", 10), 100)


def test_scheduler_errors():
    cases = [
        (SchedulerOptions("cosine_wobble"), "--lr_scheduler: expected one of"),
        (SchedulerOptions("cosine_with_min_lr", 10), "needs --lr_scheduler_min_lr_ratio"),
        (SchedulerOptions("warmup_stable_decay", 60, lr_decay_steps=50), r"\(60\) \+ --lr_decay_steps \(50\) exceed"),
        (SchedulerOptions("linear", 200), "--lr_warmup_steps: 200 is more than the 100 training steps"),
        (SchedulerOptions("piecewise_constant"), "needs --lr_scheduler_args step_rules"),
        (SchedulerOptions("linear", lr_scheduler_args={"gamma": 0.5}), "gamma not used by --lr_scheduler linear"),
        (SchedulerOptions("adafactor"), "needs --optimizer_type AdaFactor"),
        (SchedulerOptions(lr_scheduler_type="torch.optim.lr_scheduler.NoSuchLR"), "--lr_scheduler_type"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            create_scheduler(sgd(), options, 100)


def test_custom_scheduler_type():
    options = SchedulerOptions(lr_scheduler_type="StepLR", lr_scheduler_args=parse_scheduler_args(["step_size=10", "gamma=0.5"]))
    sched = create_scheduler(sgd(), options, 100)
    assert type(sched).__name__ == "StepLR"
    assert lrs_at(sched, [0, 9, 10, 25]) == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ConfigError, match="--lr_scheduler_args: StepLR rejected"):
        create_scheduler(sgd(), SchedulerOptions(lr_scheduler_type="StepLR", lr_scheduler_args={"bogus": 1}), 100)


def test_adafactor_schedule_reports_adafactor_step_size():
    param = torch.nn.Parameter(torch.zeros(4))
    opt, _, descriptor = create_optimizer([param], OptimizerOptions("AdaFactor", learning_rate=1e-4))
    assert descriptor.lr_scheduler_override == "adafactor:0.0001"
    sched = create_scheduler(opt, SchedulerOptions("cosine_with_restarts"), 100)  # replaced, as in sd-scripts
    assert type(sched).__name__ == "AdafactorLR"
    assert sched.get_last_lr() == [1e-4]
    param.grad = torch.ones(4)
    opt.step()
    sched.step()
    # relative step min(1e-2, 1/sqrt(1)) times max(eps2 = 1e-3, RMS(param) = 0)
    assert sched.get_last_lr() == pytest.approx([1e-5])


def test_schedule_free_gets_a_constant_schedule():
    pytest.importorskip("schedulefree")
    opt, _, descriptor = create_optimizer([torch.nn.Parameter(torch.zeros(2))],
                                          OptimizerOptions("AdamWScheduleFree", learning_rate=1e-3))
    sched = create_scheduler(opt, SchedulerOptions("linear", 10), 100, descriptor)
    assert lrs_at(sched, [0, 50, 99]) == [1e-3, 1e-3, 1e-3]


def test_lr_log_names():
    assert lr_log_names(["textencoder", "unet"]) == ["lr/textencoder", "lr/unet"]
    assert lr_log_names(["unet", "unet plus"]) == ["lr/unet", "lr/unet plus"]
    assert lr_log_names(None, 1) == ["lr/unet"]
    assert lr_log_names(None, 2, text_encoder_first=True) == ["lr/textencoder", "lr/unet"]
    assert lr_log_names(None, 4, text_encoder_first=True) == ["lr/textencoder", "lr/group0", "lr/group1", "lr/group2"]
    assert lr_log_names(None, 3) == ["lr/group0", "lr/group1", "lr/group2"]
    assert lr_log_names(["unet", "unet"]) == ["lr/unet", "lr/unet 1"]


def test_lr_logs_with_d_adaptation():
    opt = sgd(lr=0.5, groups=2)
    for group in opt.param_groups:
        group["d"] = 1e-3
    sched = create_scheduler(opt, SchedulerOptions("constant"), 10)
    names = lr_log_names(["textencoder", "unet"])
    assert lr_logs(sched, opt, names, adaptive=True) == {
        "lr/textencoder": 0.5, "lr/d*lr/textencoder": 0.0005, "lr/unet": 0.5, "lr/d*lr/unet": 0.0005}
    assert lr_logs(sched, opt, names) == {"lr/textencoder": 0.5, "lr/unet": 0.5}
