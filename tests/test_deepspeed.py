"""DeepSpeed ZeRO (library/train/distributed/deepspeed_engine.py) on CPU processes: DeepSpeed's CPU accelerator over gloo.

Two torchrun processes train tiny:sd1 (a LoRA with sd-scripts' --deepspeed flags at ZeRO-2; a full fine-tune from
the environment an accelerate DeepSpeed config exports at ZeRO-3) and are compared with one plain process of twice
the batch; the helpers of tests/distributed_helpers.py record each process's writes and per-step weight hashes.
The rest checks what reaches DeepSpeed's config and what is refused, in this process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from library.core.errors import ConfigError, UserError
from tests import distributed_helpers as td
from tests.distributed_helpers import TORCHRUN, dataset, launch, read_trace, train_args
from tests.train_helpers import make_trainer

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed not installed (DS_BUILD_OPS=0 pip install deepspeed)")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")

CPU_ENV = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator (it would pick it itself without a GPU)
SGD = ["--optimizer_type", "SGDNesterov", "--learning_rate", "0.5"]  # Adam magnifies float rounding (docs/distributed.md)


# The worker of tests/distributed_helpers.py, running several trainings one after the other in the same two processes
# (one start-up instead of one per training): the arguments are parts separated by "--then"; a part may begin with
# "--script <file>" and "--env <JSON object of variables>" (set for that part only); part i writes its trace to $SDTRAIN_DISTRIBUTED_TRACE
# for i = 0, then to <that>2, <that>3, ...
SEVERAL = td.WORKER.replace(
    'sys.argv = [os.path.join(os.environ["REPO"], os.environ.get("SCRIPT", "train_network.py"))] + sys.argv[1:]\n'
    'runpy.run_path(sys.argv[0], run_name="__main__")', """
import json
parts, part = [], []
for arg in sys.argv[1:]:
    if arg == "--then":
        parts.append(part)
        part = []
    else:
        part.append(arg)
parts.append(part)
trace = os.environ["SDTRAIN_DISTRIBUTED_TRACE"]
for i, argv in enumerate(parts):
    script, env = "train_network.py", {}
    if argv[0] == "--script":
        script, argv = argv[1], argv[2:]
    if argv[0] == "--env":
        env, argv = json.loads(argv[1]), argv[2:]
    os.environ.update(env, SDTRAIN_DISTRIBUTED_TRACE=trace + (str(i + 1) if i else ""))
    sys.argv = [os.path.join(os.environ["REPO"], script)] + argv
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    for key in env:
        del os.environ[key]
""")
assert SEVERAL != td.WORKER


def _written(tmp: str, rank: int) -> list[str]:
    with open(os.path.join(tmp, "audit", f"writes{rank}.txt")) as f:
        return [line for line in f.read().split("\n") if line]


def _worst(a: dict, b: dict, keys) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in keys)


def _zero3_env(tmp: str) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch --config_file <deepspeed, zero 3>` exports to its processes."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    from library.cli.accelerate_config import LaunchSettings, write
    from tests.distributed_helpers import launch_args

    config = os.path.join(tmp, "zero3.yaml")
    write(LaunchSettings(strategy="deepspeed", num_processes=2, zero_stage=3, mode="finetune"), config)
    _, env = prepare_deepspeed_cmd_env(launch_args(config))
    exported = {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}
    assert exported["ACCELERATE_USE_DEEPSPEED"] == "true" and exported["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    return exported


@needs_torchrun
def test_zero2_lora_and_zero3_fine_tune_on_two_processes_equal_one_process(tmp_path, monkeypatch):
    """In the same 2 torchrun processes x batch 1 (one start-up): (1) train_network.py --deepspeed --zero_stage 2,
    saving a state at step 2; (2) both processes resume from it; (3) fine_tune.py with the variables an accelerate
    DeepSpeed ZeRO-3 config exports, training the text encoder (partitioned over the processes). Each result equals
    1 plain process x batch 2, the resumed steps are bitwise the uninterrupted ones, and rank 1 writes nothing.
    (ZeRO-3 of the whole tiny UNet also trains here, to 1.2e-7 of one process, but DeepSpeed's per-module
    bookkeeping makes that ~60 s for 2 steps on CPU: the text encoder is cheaper.)"""
    tmp = str(tmp_path)
    data = dataset(tmp)
    out, logs = os.path.join(tmp, "out"), os.path.join(tmp, "logs")
    cached = ["--cache_latents", "--cache_latents_to_disk"]  # every run reads the same latents
    ds = ["--deepspeed", "--zero_stage", "2", *cached, *SGD]
    state = os.path.join(out, "lora-step00000002-state")
    first = train_args(data, out, logs, steps=4, extra=ds + ["--save_every_n_steps", "2"])
    again = train_args(data, os.path.join(tmp, "resumed"), logs, steps=4, extra=ds + ["--resume", state])

    def ft_args(out_dir: str, batch: int) -> list[str]:
        return ["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir", data, "--caption_extension",
                ".txt", "--resolution", "64", "--train_batch_size", str(batch), "--max_data_loader_n_workers", "0",
                *cached, *SGD[:2], "--learning_rate", "0", "--train_text_encoder", "--learning_rate_te", "0.05",
                "--max_train_steps", "2", "--seed", "123", "--cpu", "--output_dir", out_dir, "--output_name", "model",
                "--save_model_as", "safetensors"]

    zero3 = json.dumps(_zero3_env(tmp))
    monkeypatch.setattr(td, "WORKER", SEVERAL)
    launch(tmp, 1, first + ["--then"] + again + ["--then", "--script", "fine_tune.py", "--env", zero3] +
           ft_args(os.path.join(tmp, "ft"), 1), env_extra=CPU_ENV, timeout=400,
           audit_roots=[out, logs, os.path.join(tmp, "resumed"), os.path.join(tmp, "ft")])
    assert _written(tmp, 1) == []  # rank 1 took part in every gathering (state partitions, weights) but wrote nothing

    # (1) ZeRO-2 partitions the optimizer state and the gradients; the weights are whole and equal on both processes
    trace = read_trace(tmp)
    assert [t["step"] for t in trace[0]] == [1, 2, 3, 4]
    assert [t["params"] for t in trace[0]] == [t["params"] for t in trace[1]]
    assert len({t["params"] for t in trace[0]}) == 4
    assert sorted(os.listdir(out)) == ["lora-state", "lora-step00000002-state", "lora-step00000002.safetensors",
                                       "lora.safetensors", "lora_config.toml"]
    saved = torch.load(os.path.join(state, "optimizer.bin"), weights_only=False)
    assert saved["deepspeed_zero_stage"] == 2 and len(saved["partitions"]) == 2  # each process's ZeRO partition
    # (2) resumed at step 2: steps 3-4 see the same images and reach bitwise the same weights and file
    resumed = read_trace(tmp, "trace2")
    for r in (0, 1):
        assert [(t["step"], t["images"], t["params"]) for t in resumed[r]] == \
            [(t["step"], t["images"], t["params"]) for t in trace[r][2:]]
    two = load_file(os.path.join(out, "lora.safetensors"))
    resumed_file = load_file(os.path.join(tmp, "resumed", "lora.safetensors"))
    assert all(torch.equal(two[k], resumed_file[k]) for k in two)
    single = train_args(data, os.path.join(tmp, "one"), os.path.join(tmp, "logs1"), steps=4, extra=cached + SGD)
    single[single.index("--train_batch_size") + 1] = "2"
    make_trainer(single).run()
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert two.keys() == one.keys() and len(one) == 792  # the same kohya keys as single-process training
    assert all(two[k].dtype == one[k].dtype == torch.float32 for k in one)
    worst = _worst(two, one, [k for k in one if not k.endswith("alpha")])
    moved = max(one[k].abs().max().item() for k in one if "lora_up" in k)
    print(f"ZeRO-2 LoRA 2x1 vs plain 1x2: largest difference {worst:.3g}; largest lora_up weight {moved:.3g}")
    assert worst <= 1e-6, worst
    assert moved >= 1e-2

    # (3) the ZeRO-3 fine-tune's saved model (its gathered weights) against one plain process
    assert sorted(os.listdir(os.path.join(tmp, "ft"))) == ["model.safetensors", "model_config.toml"]
    from library.cli.entry import build_parser, parse_with_config_file, settings_from_args
    from library.families import get_family
    from library.train.trainer import Trainer

    family = get_family("sd")
    ns = parse_with_config_file(build_parser("test", family, fine_tune=True), ft_args(os.path.join(tmp, "ft1"), 2))
    settings = settings_from_args(ns, family, fine_tune=True)
    start = {}
    settings.hooks.append(lambda trainer, event, step: event == "train_start" and start.update(
        {k: v.clone() for k, v in trainer.components.text_encoders[0].state_dict().items()}))
    Trainer(family, settings).run()
    two = load_file(os.path.join(tmp, "ft", "model.safetensors"))
    one = load_file(os.path.join(tmp, "ft1", "model.safetensors"))
    assert two.keys() == one.keys() and len(one) > 1000
    te = [k for k in one if k.startswith("cond_stage_model.") and "position_ids" not in k]
    worst = _worst(two, one, te)
    moved = max((one[k] - start[k.split("cond_stage_model.transformer.text_model.", 1)[1]]).abs().max().item()
                for k in te)
    print(f"ZeRO-3 text encoder 2x1 vs plain 1x2: largest weight difference {worst:.3g}; largest change {moved:.3g}")
    assert worst <= 1e-6, worst
    assert moved >= 1e-3  # it trained: 10^3 times the tolerance
    assert all(torch.equal(two[k], one[k]) for k in one if k not in te)  # the UNet and VAE are written as loaded


# --- in this process: what reaches DeepSpeed, what is refused --------------------------------------------------------

def _ds_trainer(tmp_path, *extra, family: str = "sd"):
    data = dataset(str(tmp_path), n=2)
    argv = train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1, extra=list(extra))
    if family == "flux":
        argv[argv.index("tiny:sd1")] = "tiny:flux"
        argv[argv.index("networks.lora")] = "networks.lora_flux"
    return make_trainer(argv, family)


def test_flags_reach_the_deepspeed_config(tmp_path):
    from library.train.distributed.deepspeed_engine import ZeroConfig

    trainer = _ds_trainer(tmp_path, "--deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "cpu",
                          "--offload_param_device", "cpu", "--zero3_save_16bit_model", "--mixed_precision", "bf16",
                          "--gradient_accumulation_steps", "4", "--max_grad_norm", "0.5")
    t = trainer.s.training
    zero = ZeroConfig(t.deepspeed)
    assert (zero.stage, zero.save_16bit, zero.from_flags) == (3, True, True)
    config = zero.complete(micro_batch=trainer.s.data.train_batch_size, accumulation=t.gradient_accumulation_steps,
                           world_size=2, max_grad_norm=trainer.s.optimizer.max_grad_norm,
                           mixed_precision=t.mixed_precision, client_optimizer=True)
    z = config["zero_optimization"]
    assert (z["stage"], z["offload_optimizer"]["device"], z["offload_param"]["device"]) == (3, "cpu", "cpu")
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (1, 4, 8, 0.5)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["zero_allow_untested_optimizer"] is True and config["zero_force_ds_cpu_optimizer"] is False
    # and DeepSpeed itself reads it so (outside a process group it counts one process)
    from deepspeed.runtime.config import DeepSpeedConfig

    one = ZeroConfig(t.deepspeed).complete(1, 4, 1, 0.5, "bf16", client_optimizer=True)
    read = DeepSpeedConfig(one)
    assert (read.zero_optimization_stage, read.bfloat16_config.enabled, read.float16_config.enabled,
            read.gradient_clipping,
            read.train_batch_size, read.gradient_accumulation_steps) == (3, True, False, 0.5, 4, 4)
    assert read.zero_config.offload_optimizer.device == "cpu" and read.zero_config.offload_param.device == "cpu"


def test_fp16_maps_to_deepspeed_loss_scaling(tmp_path):
    from library.train.distributed.deepspeed_engine import ZeroConfig

    trainer = _ds_trainer(tmp_path, "--deepspeed", "--mixed_precision", "fp16", "--max_grad_norm", "0")
    zero = ZeroConfig(trainer.s.training.deepspeed)
    config = zero.complete(1, 1, 1, 0.0, "fp16", client_optimizer=True)
    assert config["fp16"] == {"enabled": True, "auto_cast": False, "initial_scale_power": 0}
    assert config["bf16"] == {"enabled": False} and config["gradient_clipping"] == 0.0
    assert config["zero_optimization"]["stage"] == 2  # sd-scripts' default --zero_stage


def test_an_accelerate_config_value_that_disagrees_with_the_flags_is_refused(tmp_path, monkeypatch):
    from library.train.distributed.deepspeed_engine import ZeroConfig

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    zero = ZeroConfig(None)
    assert (zero.stage, zero.from_flags) == (1, False)
    with pytest.raises(ConfigError, match=r"^DeepSpeed config gradient_accumulation_steps = 1: this run has 4 "
                                          r"\(--gradient_accumulation_steps\)"):
        zero.complete(1, 4, 2, 1.0, "no", client_optimizer=True)


@pytest.mark.parametrize("extra,message", [
    (["--zero_stage", "3"], "--zero_stage: only used with --deepspeed"),
    (["--deepspeed", "--offload_param_device", "cpu"], "--offload_param_device cpu: parameters are sharded .*stage 3, "
                                                       "got --zero_stage 2"),
    (["--deepspeed", "--offload_optimizer_device", "nvme"], "--offload_optimizer_device nvme: needs "
                                                            "--offload_optimizer_nvme_path"),
    (["--deepspeed", "--fp16_master_weights_and_gradients"], "--fp16_master_weights_and_gradients: DeepSpeed "
                                                             "supports it only with --zero_stage 2"),
])
def test_bad_deepspeed_flags_are_refused_in_one_line(tmp_path, extra, message):
    with pytest.raises(ConfigError, match="^" + message):
        _ds_trainer(tmp_path, *extra)


@pytest.mark.parametrize("family,extra,message", [
    ("flux", ["--blocks_to_swap", "1"], "--blocks_to_swap is not supported with it"),
    ("sd", ["--torch_compile"], "--torch_compile is not supported with it yet"),
    ("sd", ["--zero_stage", "3", "--use_ema"], "--use_ema is not supported with it yet"),
    ("sd", ["--optimizer_type", "AdamWScheduleFree"], "--optimizer_type AdamWScheduleFree: schedule-free optimizers"),
])
def test_what_does_not_combine_with_deepspeed_is_refused_before_loading(tmp_path, family, extra, message):
    trainer = _ds_trainer(tmp_path, "--deepspeed", *extra, family=family)
    with pytest.raises(UserError, match=r"^DeepSpeed \(ZeRO stage \d.*\): " + message):
        trainer._setup_accelerator()
    assert trainer.components is None  # refused before any model loads


def test_a_deepspeed_accelerate_launch_with_fused_backward_is_refused(tmp_path, monkeypatch):
    from tests.distributed_helpers import dataset as make_data

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch exports for a DeepSpeed config
    data = make_data(str(tmp_path), n=2)
    from library.cli.entry import build_parser, parse_with_config_file, settings_from_args
    from library.families import get_family
    from library.train.trainer import Trainer

    family = get_family("sd")
    argv = ["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir", data, "--output_dir",
            str(tmp_path / "out"), "--fused_backward_pass", "--optimizer_type", "AdamW", "--max_grad_norm", "0"]
    ns = parse_with_config_file(build_parser("test", family, fine_tune=True), argv)
    trainer = Trainer(family, settings_from_args(ns, family, fine_tune=True))
    with pytest.raises(UserError, match=r"^DeepSpeed \(ZeRO stage 2, .*from the accelerate config\): "
                                        r"--fused_backward_pass"):
        trainer._setup_accelerator()
