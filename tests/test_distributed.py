"""Data parallel: 2 CPU processes over gloo (torchrun) on the tiny SD1 preset, one machine and two loopback "nodes".

Each process writes a per-step trace (library/train/distributed.py TRACE_ENV: its images and a sha256 of its
trained weights) and, through an audit hook installed by the worker below, every path it opened for writing,
created, renamed or removed. The tests read those back: disjoint batches, bitwise-equal weights after every
step, files written by rank 0 only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

from library.core.errors import UserError
from library.data.batching import Group, plan_epoch
from library.train.distributed import GradientReducer, _buckets
from tests.train_helpers import make_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = shutil.which("torchrun")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")

WORKER = r'''
import atexit, os, runpy, sys
roots = tuple(os.path.realpath(r) for r in os.environ["AUDIT_ROOTS"].split(os.pathsep))
seen = []
def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        paths = [path] if writing else []
    elif event in ("os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "shutil.copyfile"):
        paths = list(args[:2]) if event == "os.rename" else [args[0]]
    else:
        return
    for p in paths:
        if isinstance(p, (str, bytes, os.PathLike)):
            p = os.path.realpath(os.fsdecode(p))
            if p.startswith(roots):
                seen.append(event + " " + p)
def dump():
    with open(os.path.join(os.environ["AUDIT_DIR"], "writes%s.txt" % os.environ["RANK"]), "w") as f:
        f.write("\n".join(seen))
atexit.register(dump)
sys.addaudithook(hook)
sys.argv = [os.path.join(os.environ["REPO"], "train_network.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dataset(root: str, n: int = 8) -> str:
    """n images, repeats 1, one 64x64 bucket: an epoch is n batches of 1, each image once."""
    folder = os.path.join(root, "train", "1_sks toy")
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        img = np.zeros((64, 64, 3), np.uint8) + np.uint8(i * 29)
        img[16:32, 16:32] = 255 - i * 29
        Image.fromarray(img).save(os.path.join(folder, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(f"sks toy, color {i}")
    return os.path.join(root, "train")


def train_args(data: str, out: str, logs: str, steps: int, extra=()) -> list[str]:
    return ["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir", data, "--caption_extension", ".txt",
            "--resolution", "64", "--train_batch_size", "1", "--max_data_loader_n_workers", "0",
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
            "--learning_rate", "1e-3", "--max_train_steps", str(steps), "--seed", "123", "--cpu",
            "--output_dir", out, "--output_name", "lora", "--logging_dir", logs, "--save_state", *extra]


def launch(tmp, nodes: int, argv: list[str], timeout: int = 150) -> None:
    """torchrun with 2 processes in all: one node of 2 or two loopback nodes of 1; raises with the logs on failure."""
    worker = os.path.join(tmp, "worker.py")
    with open(worker, "w") as f:
        f.write(WORKER)
    audit = os.path.join(tmp, "audit")
    os.makedirs(audit, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, REPO=REPO, AUDIT_DIR=audit,
               AUDIT_ROOTS=os.pathsep.join([os.path.join(tmp, "out"), os.path.join(tmp, "logs")]),
               SDTRAIN_DISTRIBUTED_TRACE=os.path.join(tmp, "trace"), LOGLEVEL="WARNING")
    port = free_port()
    if nodes == 1:
        commands = [[TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]]
    else:
        commands = [[TORCHRUN, "--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "1",
                     "--rdzv_endpoint", f"127.0.0.1:{port}"] for r in range(2)]
    procs = []
    for i, cmd in enumerate(commands):
        log = open(os.path.join(tmp, f"launch{i}.log"), "w")
        procs.append((subprocess.Popen(cmd + [worker] + argv, env=env, cwd=REPO, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            codes.append("timeout")
        log.close()
    if any(c != 0 for c in codes):
        logs = "\n".join(open(os.path.join(tmp, f"launch{i}.log")).read()[-3000:] for i in range(len(commands)))
        raise AssertionError(f"torchrun exited with {codes}:\n{logs}")


def read_trace(tmp) -> dict[int, list[dict]]:
    out = {}
    for rank in (0, 1):
        with open(os.path.join(tmp, "trace", f"rank{rank}.jsonl")) as f:
            out[rank] = [json.loads(line) for line in f]
    return out


def check_run(tmp, steps: int, images: int) -> dict[int, list[dict]]:
    """(a) disjoint batches covering each epoch, (b) equal weights after every step, (d) rank 0 wrote every file."""
    trace = read_trace(tmp)
    assert [t["step"] for t in trace[0]] == [t["step"] for t in trace[1]] == list(range(1, steps + 1))
    # (b) bitwise-equal trained weights on both processes after every optimizer step
    assert [t["params"] for t in trace[0]] == [t["params"] for t in trace[1]]
    assert len({t["params"] for t in trace[0]}) == steps  # and they do change every step
    # (a) within an epoch the processes' images are disjoint and together the whole dataset
    for epoch in {t["epoch"] for t in trace[0]}:
        seen = [[name for t in trace[r] if t["epoch"] == epoch for name in t["images"]] for r in (0, 1)]
        assert not set(seen[0]) & set(seen[1])
        if len(seen[0]) == images // 2:  # a complete epoch
            assert sorted(seen[0] + seen[1]) == [f"img{i}.png" for i in range(images)]
    # (d) only rank 0 opened a file for writing, created, renamed or removed anything under out/ and logs/
    audit = {r: open(os.path.join(tmp, "audit", f"writes{r}.txt")).read().split("\n") for r in (0, 1)}
    assert audit[1] == [""], audit[1][:5]
    assert any(line.endswith("lora_config.toml") for line in audit[0])
    assert any("tfevents" in line for line in audit[0])
    assert sorted(os.listdir(os.path.join(tmp, "out"))) == ["lora-state", "lora.safetensors", "lora_config.toml"]
    state = os.path.join(tmp, "out", "lora-state")
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(state))
    with open(os.path.join(state, "train_state.json")) as f:
        assert json.load(f)["world_size"] == 2
    return trace


@needs_torchrun
def test_two_processes_shard_batches_agree_on_weights_and_only_rank0_writes(tmp_path):
    tmp = str(tmp_path)
    data = dataset(tmp)
    out, logs = os.path.join(tmp, "out"), os.path.join(tmp, "logs")
    launch(tmp, 1, train_args(data, out, logs, steps=6))  # 8 images / 2 processes: 4 steps per epoch
    check_run(tmp, steps=6, images=8)
    with safe_open(os.path.join(out, "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_total_batch_size"] == "2"  # batch 1 x 2 processes x accumulation 1
    assert meta["ss_num_batches_per_epoch"] == "4"  # per process, as sd-scripts' prepared DataLoader
    assert meta["ss_num_epochs"] == "2" and meta["ss_steps"] == "6"
    # A state of 2 processes does not resume in 1: one line naming both counts.
    trainer = make_trainer(train_args(data, out, logs, steps=8)[:-1] + ["--resume", os.path.join(out, "lora-state")])
    with pytest.raises(UserError, match=r"saved by a run of 2 process\(es\), this run has 1"):
        trainer.run()


@needs_torchrun
def test_two_loopback_nodes_one_process_each(tmp_path):
    tmp = str(tmp_path)
    data = dataset(tmp)
    launch(tmp, 2, train_args(data, os.path.join(tmp, "out"), os.path.join(tmp, "logs"), steps=5,
                              extra=["--ddp_timeout", "2"]))
    check_run(tmp, steps=5, images=8)


# --- the pieces, in one process ---------------------------------------------------------------------------------

def _group(n: int, batch: int = 1) -> Group:
    return Group(dataset=0, resolution=(64, 64), batch_size=batch, buckets={(64, 64): list(range(n))})


@pytest.mark.parametrize("n,world", [(8, 2), (7, 2), (9, 3), (5, 1), (10, 4)])
def test_epoch_plan_is_shared_out_disjoint_and_equal(n, world):
    groups = [_group(n)]
    whole = plan_epoch(groups, [0], seed=5, epoch=2, start_step=10, grad_accum=2, limit=None)
    shares = [plan_epoch(groups, [0], 5, 2, 10, 2, None, rank=r, world_size=world) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # every process takes the same number of steps
    seen = [sid for s in shares for ref in s for sid in ref.samples]
    assert len(seen) == len(set(seen))  # disjoint
    rest = n % world  # batches of all processes hold `world` samples; a shorter last one is dropped
    assert len(seen) == n - rest and set(seen) <= set(range(n))
    for s in shares:
        for k, ref in enumerate(s):
            assert ref.index == k and ref.step == 10 + k // 2  # global optimizer step
    if world == 1:
        assert shares[0] == whole


def test_two_processes_of_batch_1_see_what_one_process_of_batch_2_sees():
    """The places of samples do not depend on the number of processes (item (c)'s precondition)."""
    one = plan_epoch([_group(10, batch=2)], [0], 3, 1, 0, 1, None)
    two = [plan_epoch([_group(10, batch=1)], [0], 3, 1, 0, 1, None, rank=r, world_size=2) for r in range(2)]
    assert len(one) == len(two[0]) == len(two[1]) == 5
    for ref, a, b in zip(one, *two):
        assert ref.samples == a.samples + b.samples and (a.offset, b.offset) == (0, 1)
        assert ref.index == a.index == b.index


def test_progressive_limit_counts_batches_of_all_processes():
    groups = [_group(10)]
    shares = [plan_epoch(groups, [0], 1, 1, 0, 1, limit=3, rank=r, world_size=2) for r in range(2)]
    assert [len(s) for s in shares] == [3, 3]


def test_gradient_buckets_and_reducer_single_process():
    import torch

    ts = [torch.zeros(10), torch.zeros(10, dtype=torch.float16), torch.zeros(30), torch.zeros(5)]
    assert sorted(map(sorted, _buckets(ts, limit=100))) == [[0], [1], [2], [3]]
    assert sorted(map(sorted, _buckets(ts, limit=1000))) == [[0, 2, 3], [1]]
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    GradientReducer([p]).reduce()  # one process: unchanged
    assert torch.equal(p.grad, torch.full((3,), 2.0))


def test_ddp_flags_reach_accelerate(tmp_path):
    data = dataset(str(tmp_path), n=2)
    trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1,
                                      extra=["--ddp_timeout", "7", "--ddp_static_graph"]))
    trainer._setup_accelerator()
    acc = trainer.accelerator
    assert acc.init_handler is not None and acc.init_handler.timeout.total_seconds() == 7 * 60
    assert acc.ddp_handler is not None and acc.ddp_handler.static_graph and not acc.ddp_handler.gradient_as_bucket_view


@needs_torchrun
def test_same_seed_same_lora_whatever_the_world_size(tmp_path):
    """Item (c): 2 processes x batch 1 train the LoRA that 1 process x batch 2 trains (float tolerance below):
    the plan puts every sample in the same place, and its noise and timestep come from its own seed."""
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp)
    extra = ["--cache_latents", "--cache_latents_to_disk",  # both runs read the same latents
             "--optimizer_type", "SGDNesterov", "--learning_rate", "0.5"]
    launch(tmp, 1, train_args(data, os.path.join(tmp, "out"), os.path.join(tmp, "logs"), steps=4, extra=extra))
    single = train_args(data, os.path.join(tmp, "one"), os.path.join(tmp, "logs1"), steps=4, extra=extra)
    single[single.index("--train_batch_size") + 1] = "2"
    make_trainer(single).run()
    two = load_file(os.path.join(tmp, "out", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert two.keys() == one.keys()
    worst = max((two[k].float() - one[k].float()).abs().max().item() for k in two if not k.endswith("alpha"))
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)  # lora_up starts at 0
    print(f"largest difference {worst:.3g}; largest lora_up weight {moved:.3g}")
    assert worst <= 1e-6, worst  # float32 rounding (summation order); measured 1.9e-7
    assert moved >= 1e-2  # the LoRA trained: 10^4 times the tolerance
