"""FSDP (library/train/sharding.py, sharding_fsdp1.py): 2 CPU processes over gloo (torchrun) on the tiny SD1 preset
with the FSDP_* variables accelerate's launcher exports, against 1 process of twice the batch; and the settings
read from those variables, refused in one line where they cannot combine.

The launches, traces and write audits are those of tests/test_distributed.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from library.core.errors import ConfigError
from library.train.sharding import FsdpSettings
from tests.test_distributed import dataset, launch, needs_torchrun, read_trace, train_args
from tests.train_helpers import make_trainer

FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_RESHARD_AFTER_FORWARD": "true"}


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if not k.endswith("alpha"))


@needs_torchrun
def test_fsdp2_lora_equals_one_process(tmp_path):
    """train_network.py under an FSDP2 config with activation checkpointing: the frozen UNet and text encoder are
    sharded with the LoRA modules inside their blocks; each process holds different shards of the LoRA, only
    rank 0 writes, and the file equals (keys, shapes, values within float32 rounding) the one 1 process x batch 2
    trains without checkpointing."""
    tmp = str(tmp_path)
    data = dataset(tmp)
    extra = ["--cache_latents", "--cache_latents_to_disk", "--optimizer_type", "SGDNesterov", "--learning_rate", "0.5"]
    launch(tmp, 1, train_args(data, os.path.join(tmp, "out"), os.path.join(tmp, "logs"), steps=3, extra=extra),
           env_extra={**FSDP2_ENV, "FSDP_ACTIVATION_CHECKPOINTING": "true"})
    trace = read_trace(tmp)
    assert [t["step"] for t in trace[0]] == [1, 2, 3]
    assert all(a["params"] != b["params"] for a, b in zip(trace[0], trace[1]))  # different shards on each
    with open(os.path.join(tmp, "audit", "writes1.txt")) as f:
        assert f.read() == ""  # rank 1 took part in every gather but wrote nothing
    single = train_args(data, os.path.join(tmp, "one"), os.path.join(tmp, "logs1"), steps=3, extra=extra)
    single[single.index("--train_batch_size") + 1] = "2"
    make_trainer(single).run()
    two = load_file(os.path.join(tmp, "out", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert sorted(two) == sorted(one) and len(one) > 100
    assert all(two[k].shape == one[k].shape and two[k].dtype == one[k].dtype for k in one)
    worst = largest_difference(two, one)
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)  # lora_up starts at 0
    print(f"FSDP2 LoRA 2x1 vs 1x2: largest difference {worst:.3g}; largest lora_up weight {moved:.3g}")
    assert worst <= 1e-6, worst
    assert moved >= 1e-2


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
    the model without sharding or checkpointing, bitwise."""
    from library.train.sharding import shard_parts

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
    assert all(torch.equal(grads[n], p.grad) for n, p in plain.named_parameters() if p.requires_grad)
    again = copy.deepcopy(plain)
    shard_parts({"denoiser": again}, s, ("Block",), checkpointed=frozenset({"denoiser"}))
    Block.calls = 0
    again(x).square().sum().backward()
    assert Block.calls == 2  # a part --gradient_checkpointing already checkpoints is not checkpointed twice


def test_fsdp2_blocks_compile_after_sharding(one_process_group):
    """--torch_compile with FSDP2: the blocks are compiled after fully_shard (dynamo traces them with FSDP's
    hooks around them) and train to the gradients of the plain model. The eager backend keeps it quick; inductor
    was measured the same way (24 s on this machine, equal within 1e-6)."""
    from library.train.compile import CompileOptions, compile_blocks
    from library.train.sharding import shard_parts

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
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        if q.grad is not None:
            assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6), name
