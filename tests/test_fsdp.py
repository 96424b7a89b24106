"""FSDP (library/train/distributed/sharding.py, sharding_fsdp1.py): 2 CPU processes over gloo (torchrun) on the tiny SD1 preset
with the FSDP_* variables accelerate's launcher exports, against 1 process of twice the batch; and the settings
read from those variables, refused in one line where they cannot combine.

The launches, traces and write audits are those of tests/distributed_helpers.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.train.distributed.sharding import FsdpSettings
from tests.distributed_helpers import dataset, launch, needs_torchrun, read_trace, train_args
from tests.train_helpers import assert_close_measured, make_trainer

FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_RESHARD_AFTER_FORWARD": "true"}
FSDP1_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_BACKWARD_PREFETCH": "BACKWARD_POST",
             "FSDP_FORWARD_PREFETCH": "true", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_SYNC_MODULE_STATES": "true"}


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if not k.endswith("alpha"))


EXTRA = ["--cache_latents", "--cache_latents_to_disk", "--optimizer_type", "SGDNesterov", "--learning_rate", "0.5"]


@pytest.fixture(scope="module")
def lora_one_process(tmp_path_factory) -> tuple[str, dict]:
    """(the dataset, the LoRA 1 process x batch 2 trains on it in 3 steps): what every FSDP launch below must save.
    The launches train on the same folder, so they read the latents this run cached (a VAE encoding samples)."""
    tmp = str(tmp_path_factory.mktemp("one"))
    data = dataset(tmp)
    single = train_args(data, os.path.join(tmp, "one"), os.path.join(tmp, "logs"), steps=3, extra=EXTRA)
    single[single.index("--train_batch_size") + 1] = "2"
    make_trainer(single).run()
    return data, load_file(os.path.join(tmp, "one", "lora.safetensors"))


def check_lora_launch(tmp: str, one: dict, label: str) -> dict:
    """Different shards on each process, nothing written by rank 1, and the saved LoRA equal to `one` (keys,
    shapes, dtypes; values within float32 rounding of a different summation order)."""
    trace = read_trace(tmp)
    assert [t["step"] for t in trace[0]] == [1, 2, 3]
    assert all(a["params"] != b["params"] for a, b in zip(trace[0], trace[1]))  # different shards on each
    with open(os.path.join(tmp, "audit", "writes1.txt")) as f:
        assert f.read() == ""  # rank 1 took part in every gather but wrote nothing
    two = load_file(os.path.join(tmp, "out", "lora.safetensors"))
    assert sorted(two) == sorted(one) and len(one) > 100
    assert all(two[k].shape == one[k].shape and two[k].dtype == one[k].dtype for k in one)
    worst = largest_difference(two, one)
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)  # lora_up starts at 0
    print(f"{label} LoRA 2x1 vs 1x2: largest difference {worst:.3g}; largest lora_up weight {moved:.3g}")
    assert worst <= 1e-6, worst  # measured 1.8e-7
    assert moved >= 1e-2  # the LoRA trained: 10^4 times the tolerance
    return trace


@needs_torchrun
def test_fsdp2_lora_equals_one_process(tmp_path, lora_one_process):
    """train_network.py under an FSDP2 config with activation checkpointing: the frozen UNet and text encoder are
    sharded with the LoRA modules inside their blocks, and the file equals the one 1 process x batch 2 trains
    without checkpointing."""
    tmp, (data, one) = str(tmp_path), lora_one_process
    launch(tmp, 1, train_args(data, os.path.join(tmp, "out"), os.path.join(tmp, "logs"), steps=3, extra=EXTRA),
           env_extra={**FSDP2_ENV, "FSDP_ACTIVATION_CHECKPOINTING": "true"})
    check_lora_launch(tmp, one, "FSDP2")


@needs_torchrun
def test_fsdp1_lora_equals_one_process_and_resumes(tmp_path, lora_one_process):
    """The same under an FSDP1 config (FullyShardedDataParallel units wrapped in place, with the config's
    prefetch, sharding strategy and module-state sync); its state at step 2 (whole weights and optimizer state,
    FULL_STATE_DICT) resumes on 2 processes to bitwise the same step 3 and file."""
    tmp, (data, one) = str(tmp_path), lora_one_process
    args = train_args(data, os.path.join(tmp, "out"), os.path.join(tmp, "logs"), steps=3,
                      extra=EXTRA + ["--save_every_n_steps", "2"])
    launch(tmp, 1, args, env_extra=FSDP1_ENV)
    trace = check_lora_launch(tmp, one, "FSDP1")
    state = os.path.join(tmp, "out", "lora-step00000002-state")
    resumed = train_args(data, os.path.join(tmp, "resumed"), os.path.join(tmp, "logs2"), steps=3,
                         extra=EXTRA + ["--resume", state])
    launch(tmp, 1, resumed, env_extra=FSDP1_ENV, trace="trace2")
    again = read_trace(tmp, "trace2")
    assert [[(t["step"], t["params"]) for t in again[r]] for r in (0, 1)] == \
        [[(t["step"], t["params"]) for t in trace[r][2:]] for r in (0, 1)]
    first, second = (load_file(os.path.join(tmp, d, "lora.safetensors")) for d in ("out", "resumed"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_settings_from_accelerate_variables(monkeypatch):
    """The names and values accelerate 1.15's launcher exports for each fsdp_* config key."""
    assert FsdpSettings.from_env() is None  # no ACCELERATE_USE_FSDP: not an FSDP launch
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "A, B")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "None")  # str(None): the key is not in the config
    s = FsdpSettings.from_env()
    assert (s.version, s.block_classes, s.cpu_offload, s.reshard_after_forward) == (2, ("A", "B"), True, True)
    assert (s.activation_checkpointing, s.cpu_ram_efficient_loading, s.state_dict_type) == \
        (False, False, "FULL_STATE_DICT")
    monkeypatch.setenv("FSDP_VERSION", "1")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "2")  # accelerate's numbered form
    monkeypatch.setenv("FSDP_BACKWARD_PREFETCH", "BACKWARD_POST")
    monkeypatch.setenv("FSDP_FORWARD_PREFETCH", "true")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    s = FsdpSettings.from_env()
    assert (s.version, s.sharding_strategy, s.reshard_after_forward, s.backward_prefetch, s.forward_prefetch,
            s.state_dict_type) == (1, "SHARD_GRAD_OP", False, "BACKWARD_POST", True, "SHARDED_STATE_DICT")
    for name, value, message in [
            ("FSDP_BACKWARD_PREFETCH", "EARLY", r"^FSDP_BACKWARD_PREFETCH=EARLY: expected one of BACKWARD_PRE, "),
            ("FSDP_VERSION", "3", r"^FSDP_VERSION=3 \(accelerate config fsdp_version\): expected 1 or 2$"),
            ("FSDP_USE_ORIG_PARAMS", "maybe", r"^FSDP_USE_ORIG_PARAMS=maybe: expected true or false$")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=message):
            FsdpSettings.from_env()
        monkeypatch.delenv(name)


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one process in this test process (FSDP's collectives are then copies)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Block(torch.nn.Module):
    calls = 0

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6).requires_grad_(False)

    def forward(self, x):
        Block.calls += 1
        return torch.tanh(self.frozen(torch.tanh(self.inner(x))))


def test_fsdp2_activation_checkpointing_recomputes_blocks_with_the_same_gradients(one_process_group):
    """FSDP_ACTIVATION_CHECKPOINTING: each unit runs its forward again in backward; the gradients are those of
    the model without sharding or checkpointing, up to float rounding (FSDP's reduce-scatter and autograd's
    recompute are other computations)."""
    from library.train.distributed.sharding import shard_parts

    torch.manual_seed(0)
    plain = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(6, 2))
    sharded = copy.deepcopy(plain)
    x = torch.randn(5, 6)
    Block.calls = 0
    plain(x).square().sum().backward()
    assert Block.calls == 2
    s = FsdpSettings(activation_checkpointing=True)
    _, counts = shard_parts({"denoiser": sharded}, s, ("Block",))
    assert counts == {"denoiser": 2}
    Block.calls = 0
    sharded(x).square().sum().backward()
    assert Block.calls == 4  # each block's forward again in backward
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(n for n, p in plain.named_parameters() if p.requires_grad)
    # measured 0 with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY); float32 rounding of these 6-term sums
    # would be ~1e-7. Weights gathered in bfloat16 give 7.9e-3
    assert_close_measured(grads, {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}, 1e-6,
                          "sharded + checkpointed vs plain: gradients")
    again = copy.deepcopy(plain)
    shard_parts({"denoiser": again}, s, ("Block",), checkpointed=frozenset({"denoiser"}))
    Block.calls = 0
    again(x).square().sum().backward()
    assert Block.calls == 2  # a part --gradient_checkpointing already checkpoints is not checkpointed twice


def test_fsdp2_blocks_compile_after_sharding(one_process_group):
    """--torch_compile with FSDP2: the blocks are compiled after fully_shard (dynamo traces them with FSDP's
    hooks around them) and train to the gradients of the plain model. The eager backend keeps it quick; inductor
    was measured the same way (24 s on this machine, equal within 1e-6)."""
    from library.train.memory.compile import CompileOptions, compile_blocks
    from library.train.distributed.sharding import shard_parts

    torch.manual_seed(0)
    plain = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(6, 2))
    sharded = copy.deepcopy(plain)
    x = torch.randn(5, 6)
    plain(x).square().sum().backward()
    shard_parts({"denoiser": sharded}, FsdpSettings(), ("Block",))
    assert compile_blocks(sharded, ("Block",), CompileOptions(torch_compile=True, dynamo_backend="eager")) == 2
    for _ in range(2):  # the second step runs the compiled graphs
        sharded.zero_grad()
        sharded(x).square().sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.grad is not None}
    # measured 0 with the AVX-512, AVX2 and default kernels (ATEN_CPU_CAPABILITY); blocks compiled over float16-rounded
    # weights give 8e-4, weights gathered in bfloat16 7.9e-3
    assert_close_measured(grads, {n: q.grad for n, q in plain.named_parameters() if q.grad is not None}, 1e-6,
                          "sharded + compiled vs plain: gradients")


def test_what_cannot_combine_is_refused_in_one_line(tmp_path):
    """fsdp_unsupported: one line naming the option, before anything loads."""
    from library.train.distributed.sharding import fsdp_unsupported

    data = dataset(str(tmp_path), n=2)

    def why(extra, **fsdp):
        trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1, extra=extra))
        return fsdp_unsupported(trainer.s, FsdpSettings(**fsdp))

    assert why([]) is None and why([], version=1) is None  # LoRA under FSDP2 and FSDP1
    assert why([], version=1, use_orig_params=False).startswith("fsdp_use_orig_params false: a LoRA needs it on")
    assert why(["--torch_compile"]) is None  # FSDP2 compiles the sharded blocks
    assert why(["--torch_compile"], version=1).startswith("--torch_compile: with FSDP2 only")
    assert why(["--scale_weight_norms", "1"]).startswith("--scale_weight_norms is not supported with it")
    assert why([], cpu_ram_efficient_loading=True).startswith("fsdp_cpu_ram_efficient_loading: not supported")
    assert why([], state_dict_type="SHARDED_STATE_DICT").startswith(
        "fsdp_state_dict_type SHARDED_STATE_DICT: --save_state writes whole weights")
    lycoris = ["--network_module", "lycoris.kohya"]
    assert why(lycoris).startswith("--network_module lycoris.kohya: only networks.lora")


@pytest.mark.parametrize("flags, expected", [
    (["--strategy", "fsdp1", "--fsdp_backward_prefetch", "BACKWARD_POST", "--fsdp_forward_prefetch",
      "--fsdp_reshard_after_forward", "false", "--fsdp_activation_checkpointing"],
     dict(version=1, sharding_strategy="SHARD_GRAD_OP", backward_prefetch="BACKWARD_POST", forward_prefetch=True,
          activation_checkpointing=True, use_orig_params=True, state_dict_type="FULL_STATE_DICT",
          block_classes=("BasicTransformerBlock", "ResnetBlock2D"))),
    (["--strategy", "fsdp2", "--fsdp_cpu_offload", "--fsdp_activation_checkpointing"],
     dict(version=2, reshard_after_forward=True, cpu_offload=True, activation_checkpointing=True,
          cpu_ram_efficient_loading=False, sync_module_states=False, wrap_policy="TRANSFORMER_BASED_WRAP")),
])
def test_a_generated_config_reaches_the_loop(tmp_path, monkeypatch, flags, expected):
    """tools/make_accelerate_config.py's file -> accelerate launch's environment for the processes
    (prepare_multi_gpu_env) -> FsdpSettings.from_env: every option arrives as written."""
    from accelerate.utils.launch import prepare_multi_gpu_env

    from library.train.distributed.sharding import fsdp_unsupported
    from tests.distributed_helpers import launch_args, make_accelerate_config

    proc, path = make_accelerate_config(tmp_path, *flags, "--num_processes", "2", "--family", "sd", "--mode", "lora")
    assert proc.returncode == 0, proc.stderr
    env = prepare_multi_gpu_env(launch_args(path))
    for name, value in env.items():
        if name.startswith("FSDP_") or name == "ACCELERATE_USE_FSDP":
            monkeypatch.setenv(name, value)
    s = FsdpSettings.from_env()
    assert {k: getattr(s, k) for k in expected} == expected
    data = dataset(str(tmp_path), n=2)
    trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1))
    assert fsdp_unsupported(trainer.s, s) is None  # a LoRA run takes it as it is
