"""Optimizer names, arguments, metadata strings, and the optimizer / scheduler flags."""

import argparse
import importlib.util
import logging
import sys

import pytest
import torch

from library.cli.optimizer import (
    add_optimizer_arguments,
    optimizer_options_from_args,
    scheduler_options_from_args,
)
from library.cli.ranges import check_ranges
from library.core.errors import ConfigError
from library.train.optim.optimizers import (
    OptimizerOptions,
    create_optimizer,
    is_schedule_free,
    optimizer_string,
    parse_optimizer_args,
)


def params():
    return [torch.nn.Parameter(torch.zeros(4, 4))]


def installed(module):
    return importlib.util.find_spec(module) is not None


# --optimizer_type (any case) -> the class it builds, and the package it needs
NAMES = [
    ("AdamW", "torch.optim.adamw.AdamW", "torch"),
    ("adamw", "torch.optim.adamw.AdamW", "torch"),
    ("SGDNesterov", "torch.optim.sgd.SGD", "torch"),
    ("Lion", "lion_pytorch.lion_pytorch.Lion", "lion_pytorch"),
    ("DAdaptation", "dadaptation.experimental.dadapt_adam_preprint.DAdaptAdamPreprint", "dadaptation"),
    ("DAdaptAdamPreprint", "dadaptation.experimental.dadapt_adam_preprint.DAdaptAdamPreprint", "dadaptation"),
    ("DAdaptAdaGrad", "dadaptation.dadapt_adagrad.DAdaptAdaGrad", "dadaptation"),
    ("DAdaptAdam", "dadaptation.dadapt_adam.DAdaptAdam", "dadaptation"),
    ("DAdaptAdan", "dadaptation.dadapt_adan.DAdaptAdan", "dadaptation"),
    ("DAdaptAdanIP", "dadaptation.experimental.dadapt_adan_ip.DAdaptAdanIP", "dadaptation"),
    ("DAdaptLion", "dadaptation.dadapt_lion.DAdaptLion", "dadaptation"),
    ("DAdaptSGD", "dadaptation.dadapt_sgd.DAdaptSGD", "dadaptation"),
    ("prodigy", "prodigyopt.prodigy.Prodigy", "prodigyopt"),
    ("AdaFactor", "transformers.optimization.Adafactor", "transformers"),
    ("RAdamScheduleFree", "schedulefree.radam_schedulefree.RAdamScheduleFree", "schedulefree"),
    ("AdamWScheduleFree", "schedulefree.adamw_schedulefree.AdamWScheduleFree", "schedulefree"),
    ("SGDScheduleFree", "schedulefree.sgd_schedulefree.SGDScheduleFree", "schedulefree"),
    ("torch.optim.RMSprop", "torch.optim.rmsprop.RMSprop", "torch"),
    ("RMSprop", "torch.optim.rmsprop.RMSprop", "torch"),
]


@pytest.mark.parametrize("name, class_path, module", NAMES, ids=[n[0] for n in NAMES])
def test_optimizer_names(name, class_path, module):
    if not installed(module):
        pytest.skip(f"{module} not installed")
    lr = 1.0 if "adapt" in name.lower() or name.lower() == "prodigy" else 1e-3
    opt, got_name, descriptor = create_optimizer(params(), OptimizerOptions(name, learning_rate=lr))
    assert got_name == class_path
    assert f"{type(opt).__module__}.{type(opt).__name__}" == class_path
    assert descriptor.schedule_free == name.lower().endswith("schedulefree") == is_schedule_free(opt)
    assert descriptor.adaptive == (name.lower().startswith("dadapt") or name.lower() == "prodigy")


BNB_NAMES = ["AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "Lion8bit", "PagedLion8bit", "SGDNesterov8bit"]


@pytest.mark.parametrize("name", BNB_NAMES)
def test_missing_package_gives_install_hint(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=rf"^--optimizer_type {name} needs bitsandbytes: pip install bitsandbytes \(or, in this repository: pip install \.\[optim\]\)$"):
        create_optimizer(params(), OptimizerOptions(name))


@pytest.mark.parametrize("name, package, pip_name", [("Lion", "lion_pytorch", "lion-pytorch"),
                                                     ("Prodigy", "prodigyopt", "prodigyopt"),
                                                     ("DAdaptAdam", "dadaptation", "dadaptation"),
                                                     ("AdamWScheduleFree", "schedulefree", "schedulefree"),
                                                     ("some_pkg.optim.Fancy", "some_pkg", "some_pkg")])
def test_install_hints(name, package, pip_name, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)
    extra = "" if package == "some_pkg" else r" \(or, in this repository: pip install \.\[optim\]\)"
    with pytest.raises(ConfigError, match=f"^--optimizer_type {name} needs {pip_name}: pip install {pip_name}{extra}$"):
        create_optimizer(params(), OptimizerOptions(name))


def test_unknown_names():
    with pytest.raises(ConfigError, match="--optimizer_type: unknown optimizer 'AdamX'"):
        create_optimizer(params(), OptimizerOptions("AdamX"))
    with pytest.raises(ConfigError, match="torch.optim has no class Nope"):
        create_optimizer(params(), OptimizerOptions("torch.optim.Nope"))
    with pytest.raises(ConfigError, match="not a torch optimizer class"):
        create_optimizer(params(), OptimizerOptions("torch.nn.Linear"))


def test_parse_optimizer_args():
    parsed = parse_optimizer_args(["betas=(0.9,0.99)", "weight_decay=0.01", "decouple=True", "eps = 1e-8",
                                   "d_coef=2", "name='x'", "betas2=0.9,0.999"])
    assert parsed == {"betas": (0.9, 0.99), "weight_decay": 0.01, "decouple": True, "eps": 1e-8, "d_coef": 2,
                      "name": "x", "betas2": (0.9, 0.999)}
    assert parse_optimizer_args(None) == {}
    with pytest.raises(ConfigError, match=r"--optimizer_args: 'decay_type=cosine': value 'cosine' is not a Python literal"):
        parse_optimizer_args(["decay_type=cosine"])
    with pytest.raises(ConfigError, match="--optimizer_args: expected key=value, got 'weight_decay'"):
        parse_optimizer_args(["weight_decay"])


def test_optimizer_args_reach_the_optimizer_and_metadata():
    options = OptimizerOptions("AdamW", 1e-4, parse_optimizer_args(["weight_decay=0.01", "betas=(0.9,0.99)"]))
    opt, _, descriptor = create_optimizer(params(), options)
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.99)
    assert opt.param_groups[0]["lr"] == 1e-4
    assert descriptor.ss_optimizer == "torch.optim.adamw.AdamW(weight_decay=0.01,betas=(0.9, 0.99))"
    assert optimizer_string(opt, {}) == "torch.optim.adamw.AdamW"


def test_unknown_optimizer_arg_names_the_key():
    with pytest.raises(ConfigError, match="--optimizer_args: AdamW does not accept decouple; it accepts betas"):
        create_optimizer(params(), OptimizerOptions("AdamW", optimizer_args={"decouple": True}))


def test_decoupled_weight_decay_switch():
    """--decoupled_weight_decay (the web UI's "decoupled weight decay"): Adam's own switch turns on, and one step of
    Adam with it equals one step of AdamW with the same decay (the same rule); an explicit optimizer arg wins;
    AdamW stays as it is; an optimizer without the switch is refused in one line."""
    def one_step(options):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4))
        opt, _, descriptor = create_optimizer([w], options)
        w.grad = torch.full_like(w, 0.5)
        opt.step()
        return w.detach().clone(), opt, descriptor

    decay = {"weight_decay": 0.1}
    adam, opt, descriptor = one_step(OptimizerOptions("torch.optim.Adam", 1e-2, dict(decay), decoupled_weight_decay=True))
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    assert "decoupled_weight_decay=True" in descriptor.ss_optimizer
    adamw, _, _ = one_step(OptimizerOptions("AdamW", 1e-2, dict(decay)))
    coupled, _, _ = one_step(OptimizerOptions("torch.optim.Adam", 1e-2, dict(decay)))
    assert torch.allclose(adam, adamw, rtol=0, atol=1e-7)  # same rule; measured difference 0 here
    assert not torch.allclose(adam, coupled, rtol=0, atol=1e-4)  # L2 in the gradient is another rule
    _, opt, _ = one_step(OptimizerOptions("torch.optim.Adam", 1e-2, {**decay, "decoupled_weight_decay": False},
                                          decoupled_weight_decay=True))
    assert opt.param_groups[0]["decoupled_weight_decay"] is False
    kept, _, descriptor = one_step(OptimizerOptions("AdamW", 1e-2, dict(decay), decoupled_weight_decay=True))
    assert torch.equal(kept, adamw) and descriptor.kwargs == decay
    if installed("prodigyopt"):
        _, opt, _ = one_step(OptimizerOptions("prodigy", 1.0, {}, decoupled_weight_decay=True))
        assert opt.param_groups[0]["decouple"] is True
    with pytest.raises(ConfigError, match=r"^--decoupled_weight_decay: SGD has no decoupled weight decay switch"):
        create_optimizer(params(), OptimizerOptions("SGDNesterov", 1e-2, {}, decoupled_weight_decay=True))
    ns = argparse.ArgumentParser()
    add_optimizer_arguments(ns)
    assert optimizer_options_from_args(ns.parse_args(["--decoupled_weight_decay"])).decoupled_weight_decay is True


def test_group_lrs_are_kept():
    groups = [{"params": params(), "lr": 1e-4}, {"params": params()}]
    opt, _, _ = create_optimizer(groups, OptimizerOptions("AdamW", 5e-5))
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 5e-5]


def test_sgd_nesterov_defaults():
    opt, _, descriptor = create_optimizer(params(), OptimizerOptions("SGDNesterov", 0.1))
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["nesterov"] is True
    assert descriptor.ss_optimizer == "torch.optim.sgd.SGD(momentum=0.9,nesterov=True)"
    opt, _, _ = create_optimizer(params(), OptimizerOptions("SGDNesterov", 0.1, {"momentum": 0.5}))
    assert opt.param_groups[0]["momentum"] == 0.5


def test_legacy_flags():
    assert create_optimizer(params(), OptimizerOptions("", use_8bit_adam=False))[1] == "torch.optim.adamw.AdamW"
    if installed("lion_pytorch"):
        assert create_optimizer(params(), OptimizerOptions("", 1e-4, use_lion_optimizer=True))[2].optimizer_type == "Lion"
    with pytest.raises(ConfigError, match="--use_8bit_adam and --optimizer_type Lion: give only one"):
        create_optimizer(params(), OptimizerOptions("Lion", use_8bit_adam=True))
    with pytest.raises(ConfigError, match="--use_8bit_adam and --use_lion_optimizer"):
        create_optimizer(params(), OptimizerOptions("", use_8bit_adam=True, use_lion_optimizer=True))


@pytest.mark.skipif(not installed("prodigyopt"), reason="prodigyopt not installed")
def test_adaptive_optimizer_warnings(caplog):
    groups = [{"params": params(), "lr": 1e-4}, {"params": params(), "lr": 1.0}]
    with caplog.at_level(logging.WARNING, logger="library.train.optim.optimizers"):
        _, _, descriptor = create_optimizer(groups, OptimizerOptions("Prodigy", 1e-4, {"decouple": True}))
    text = caplog.text
    assert "learning rate 0.0001 is low for an adaptive optimizer" in text
    assert "only the first group's learning rate takes effect" in text
    assert descriptor.adaptive and descriptor.kwargs == {"decouple": True}


def test_adafactor_relative_step_handling():
    groups = [{"params": params(), "lr": 1e-4}]
    opt, _, descriptor = create_optimizer(groups, OptimizerOptions("AdaFactor", 2e-4))
    assert descriptor.lr_scheduler_override == "adafactor:0.0002"
    assert descriptor.kwargs == {"relative_step": True}
    assert opt.param_groups[0]["lr"] is None  # Adafactor picks its own step size
    opt, _, descriptor = create_optimizer(params(), OptimizerOptions("AdaFactor", 2e-4, {"relative_step": False}))
    assert descriptor.lr_scheduler_override is None and opt.param_groups[0]["lr"] == 2e-4
    _, _, descriptor = create_optimizer(params(), OptimizerOptions("AdaFactor", 2e-4, {"relative_step": False,
                                                                                       "warmup_init": True}))
    assert descriptor.kwargs["relative_step"] is True  # warmup_init needs relative_step


@pytest.mark.skipif(not installed("schedulefree"), reason="schedulefree not installed")
def test_schedule_free_train_eval():
    opt, _, descriptor = create_optimizer(params(), OptimizerOptions("AdamWScheduleFree", 1e-3))
    assert descriptor.schedule_free and is_schedule_free(opt)
    opt.train()
    opt.eval()
    assert not is_schedule_free(torch.optim.AdamW(params()))


class WrappedOptimizer:
    """Shaped like accelerate's AcceleratedOptimizer: .optimizer plus train()/eval() for any optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def train(self):
        pass

    def eval(self):
        pass


def test_is_schedule_free_looks_through_wrappers():
    assert not is_schedule_free(WrappedOptimizer(torch.optim.AdamW(params())))
    if installed("schedulefree"):
        opt, _, _ = create_optimizer(params(), OptimizerOptions("SGDScheduleFree", 1e-3))
        assert is_schedule_free(WrappedOptimizer(opt))


# --- flags ---------------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser()
    add_optimizer_arguments(parser)
    return parser.parse_args(argv)


def test_flag_defaults():
    ns = parse([])
    opt, sched = optimizer_options_from_args(ns), scheduler_options_from_args(ns)
    assert (opt.optimizer_type, opt.learning_rate, opt.optimizer_args, opt.max_grad_norm) == ("AdamW", 2e-6, {}, 1.0)
    assert (sched.lr_scheduler, sched.lr_warmup_steps, sched.lr_decay_steps) == ("constant", "0", "0")
    assert (sched.lr_scheduler_num_cycles, sched.lr_scheduler_power, sched.lr_scheduler_timescale,
            sched.lr_scheduler_min_lr_ratio, sched.lr_scheduler_type, sched.lr_scheduler_args) == (1, 1.0, None, None, "", {})


def test_flags_parse():
    ns = parse(["--optimizer_type", "Prodigy", "--learning_rate", "1", "--optimizer_args", "decouple=True",
                "weight_decay=0.01", "--lr_scheduler", "cosine_with_restarts", "--lr_warmup_steps", "5%",
                "--lr_scheduler_num_cycles", "3", "--lr_scheduler_min_lr_ratio", "0.1",
                "--lr_scheduler_args", "step_rules=1:10,0.1"])
    opt, sched = optimizer_options_from_args(ns), scheduler_options_from_args(ns)
    assert opt.optimizer_type == "Prodigy" and opt.optimizer_args == {"decouple": True, "weight_decay": 0.01}
    assert sched.lr_warmup_steps == "5%" and sched.lr_scheduler_num_cycles == 3
    assert sched.lr_scheduler_args == {"step_rules": "1:10,0.1"}  # step_rules may be unquoted
    assert optimizer_options_from_args(parse(["--use_8bit_adam"])).optimizer_type == "AdamW8bit"


@pytest.mark.parametrize("argv, message", [
    (["--lr_scheduler", "cosine_annealing"], "--lr_scheduler: expected one of constant,"),
    (["--lr_warmup_steps", "ten"], "--lr_warmup_steps: expected a step count"),
    (["--lr_decay_steps", "-3"], "--lr_decay_steps: expected a step count"),
    (["--lr_scheduler_args", "gamma"], "--lr_scheduler_args: expected key=value"),
])
def test_bad_scheduler_flags(argv, message):
    with pytest.raises(ConfigError, match=message):
        scheduler_options_from_args(parse(argv))


@pytest.mark.parametrize("argv, message", [
    (["--lr_scheduler_min_lr_ratio", "1.5"], r"^--lr_scheduler_min_lr_ratio 1.5: expected a number in \[0, 1\]$"),
    (["--lr_scheduler_num_cycles", "0"], "^--lr_scheduler_num_cycles 0: expected an integer >= 1$"),
    (["--learning_rate", "-1"], r"^--learning_rate -1: expected a number in \[0, 10\] \(learning rates above 10"),
    (["--max_grad_norm", "-1"], r"^--max_grad_norm -1: expected a number >= 0 \(0 = no clipping\)$"),
])
def test_optimizer_flag_ranges(argv, message):
    """Each flag's own range is declared with it and checked before any settings are built (check_ranges)."""
    with pytest.raises(ConfigError, match=message):
        check_ranges(vars(parse(argv)))


@pytest.mark.parametrize("argv, message", [
    (["--optimizer_args", "foo=bar"], "--optimizer_args: 'foo=bar'"),
    (["--use_lion_optimizer", "--optimizer_type", "Prodigy"], "--use_lion_optimizer and --optimizer_type Prodigy"),
])
def test_bad_optimizer_flags(argv, message):
    with pytest.raises(ConfigError, match=message):
        optimizer_options_from_args(parse(argv))
