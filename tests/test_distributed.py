"""Data parallel: 2 CPU processes over gloo (torchrun) on the tiny SD1 preset, one machine and two loopback "nodes".

Each process writes a per-step trace (library/train/distributed/distributed.py TRACE_ENV: its images and a sha256 of its
trained weights) and, through an audit hook installed by the worker below, every path it opened for writing,
created, renamed or removed. The tests read those back: disjoint batches, bitwise-equal weights after every
step, files written by rank 0 only.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest
from safetensors import safe_open

from library.core.errors import UserError
from library.data.batching import Group, plan_epoch
from tests.train_helpers import make_trainer

from tests.distributed_helpers import REPO, dataset, launch, needs_torchrun, read_trace, train_args


def check_run(tmp, steps: int, images: int, files=("lora-state", "lora.safetensors", "lora_config.toml"),
              ddp=(False, False, True)) -> dict[int, list[dict]]:
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
    assert sorted(os.listdir(os.path.join(tmp, "out"))) == sorted(files)
    # the trained weights are wrapped in DDP with the --ddp_* settings asked for (static graph, bucket view);
    # a text-encoder LoRA can miss a backward (clip_skip skips its last layer), so DDP looks for unused ones
    # unless the graph is static
    for r in (0, 1):
        assert trace[r][0]["ddp"] == {"static_graph": ddp[0], "gradient_as_bucket_view": ddp[1],
                                      "find_unused_parameters": ddp[2]}
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
    # 8 images / 2 processes: 4 steps per epoch; a state mid-epoch 2 (step 6)
    launch(tmp, 1, train_args(data, out, logs, steps=8, extra=["--save_every_n_steps", "6"]))
    trace = check_run(tmp, steps=8, images=8, files=("lora-state", "lora.safetensors", "lora_config.toml",
                                                    "lora-step00000006-state", "lora-step00000006.safetensors"))
    with safe_open(os.path.join(out, "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_total_batch_size"] == "2"  # batch 1 x 2 processes x accumulation 1
    assert meta["ss_num_batches_per_epoch"] == "4"  # per process, as sd-scripts' prepared DataLoader
    assert meta["ss_num_epochs"] == "2" and meta["ss_steps"] == "8"
    # Both processes resume from the step-6 state (each its own RNG file) and train steps 7 and 8 exactly as
    # the uninterrupted run did: same images, bitwise-equal weights.
    launch(tmp, 1, train_args(data, os.path.join(tmp, "resumed"), logs, steps=8,
                              extra=["--resume", os.path.join(out, "lora-step00000006-state")]), trace="trace2")
    resumed = read_trace(tmp, "trace2")
    for r in (0, 1):
        assert [(t["step"], t["images"], t["params"]) for t in resumed[r]] == \
            [(t["step"], t["images"], t["params"]) for t in trace[r][6:]]
    # A state of 2 processes does not resume in 1: one line naming both counts.
    trainer = make_trainer(train_args(data, out, logs, steps=8)[:-1] + ["--resume", os.path.join(out, "lora-state")])
    with pytest.raises(UserError, match=r"saved by a run of 2 process\(es\), this run has 1"):
        trainer.run()


@needs_torchrun
def test_two_loopback_nodes_one_process_each(tmp_path):
    """Also without --seed: each process draws one, and they must take rank 0's (the epoch plan is a function of
    it), or their batches overlap (check_run: disjoint batches covering the epoch)."""
    tmp = str(tmp_path)
    data = dataset(tmp)
    argv = train_args(data, os.path.join(tmp, "out"), os.path.join(tmp, "logs"), steps=5,
                      extra=["--ddp_timeout", "2", "--ddp_backend", "gloo", "--ddp_static_graph", "--ddp_gradient_as_bucket_view",
                             "--profile_steps", "--cache_latents"])  # in memory: shared by gathering
    seed = argv.index("--seed")
    del argv[seed:seed + 2]
    launch(tmp, 2, argv)
    check_run(tmp, steps=5, images=8, ddp=(True, True, False))
    # --profile_steps times DDP's bucket all-reduces (rank 0's TensorBoard events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {os.path.dirname(p) for p in glob.glob(os.path.join(tmp, "logs", "**", "events.*"), recursive=True)}
    acc = EventAccumulator(events)
    acc.Reload()
    comm = acc.Scalars("profile/allreduce_seconds")
    assert [e.step for e in comm] == [1, 2, 3, 4, 5] and all(0 < e.value < 10 for e in comm)


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


def test_step_module_one_process_and_a_turn_without_images():
    import torch

    from library.train.distributed.distributed import StepModule, data_parallel

    net = torch.nn.Linear(3, 2)
    net.bias.requires_grad_(False)
    module = StepModule(net, lambda batch, gen: ((net(batch["x"]) ** 2).mean(), None))
    assert data_parallel(module, torch.device("cpu"), find_unused_parameters=False) is module  # one process
    loss, _ = module({"x": torch.ones(4, 3)}, None)
    assert loss.item() == pytest.approx(((net(torch.ones(4, 3))) ** 2).mean().item())
    net.weight.grad = None
    zero, _ = module(None, None)  # no images on this process: zero gradients for every trained parameter
    zero.backward()
    assert zero.item() == 0.0 and torch.equal(net.weight.grad, torch.zeros(2, 3)) and net.bias.grad is None




def test_ddp_timeout_reaches_accelerate(tmp_path):
    data = dataset(str(tmp_path), n=2)
    trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1,
                                      extra=["--ddp_timeout", "7"]))
    trainer._setup_accelerator()
    acc = trainer.accelerator
    assert acc.init_handler is not None and acc.init_handler.timeout.total_seconds() == 7 * 60


def test_ddp_backend_reaches_accelerate_and_nccl_is_refused_where_it_cannot_run(tmp_path):
    from library.train.distributed.distributed import ddp_backend_problem, resolved_ddp_backend

    data = dataset(str(tmp_path), n=2)
    trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1,
                                      extra=["--ddp_backend", "gloo", "--ddp_timeout", "3"]))
    trainer._setup_accelerator()
    handler = trainer.accelerator.init_handler
    assert handler.backend == "gloo" and handler.timeout.total_seconds() == 3 * 60
    # auto: accelerate chooses (nccl on CUDA, gloo on CPU), except Windows with CUDA, where it must be gloo
    assert resolved_ddp_backend("auto", cpu=False, cuda=True, platform="linux") is None
    assert resolved_ddp_backend("auto", cpu=False, cuda=True, platform="win32") == "gloo"
    assert resolved_ddp_backend("auto", cpu=True, cuda=True, platform="win32") is None
    assert resolved_ddp_backend("nccl", cpu=False, cuda=True, platform="linux") == "nccl"
    assert ddp_backend_problem("nccl", cpu=False, cuda=True, platform="linux") is None
    assert ddp_backend_problem("gloo", cpu=True, cuda=False, platform="win32") is None
    assert ddp_backend_problem("nccl", cpu=False, cuda=False, platform="linux") == \
        "--ddp_backend nccl: needs CUDA GPUs (none found); use gloo (or auto)"
    assert ddp_backend_problem("nccl", cpu=True, cuda=True, platform="linux") == \
        "--ddp_backend nccl: needs CUDA GPUs (--cpu is given); use gloo (or auto)"
    assert "not available on Windows" in ddp_backend_problem("nccl", cpu=False, cuda=True, platform="win32")
    from library.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--ddp_backend nccl: needs CUDA GPUs"):
        make_trainer(train_args(data, str(tmp_path / "out2"), str(tmp_path / "logs2"), steps=1,
                                extra=["--ddp_backend", "nccl"]))


ACCELERATE_SIMPLE = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_lone_process_note_names_what_accelerate_launch_was_asked():
    from library.train.distributed.distributed import lone_process_note

    argv = ["/usr/bin/python", "/usr/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "train_network.py"]
    note = lone_process_note(1, ACCELERATE_SIMPLE, argv, script="train_network.py")
    assert note == ("accelerate launch was asked for 2 processes but started only this one (its launcher starts "
                    "several CPU processes only through MPI, GPU ones only with --multi_gpu): this run trains as 1 "
                    "process; for 2: `torchrun --nproc_per_node 2 train_network.py --cpu ...` (CPU) or `accelerate "
                    "launch --multi_gpu --num_processes 2 train_network.py ...` (GPUs), see docs/distributed.md")
    assert "asked for 3 processes" in lone_process_note(1, ACCELERATE_SIMPLE, ["launch", "--num-processes=3"])
    # N unreadable (another OS, another launcher line): still said, with N
    assert "asked for several processes" in lone_process_note(1, ACCELERATE_SIMPLE, [])
    assert "--nproc_per_node N" in lone_process_note(1, ACCELERATE_SIMPLE, ["launch", "--num_processes", "x"])
    # not said: several processes run; torchrun or accelerate's multi-GPU launcher (WORLD_SIZE); accelerate launch
    # asked for one (no MASTER_ADDR); not launched by accelerate at all
    assert lone_process_note(2, ACCELERATE_SIMPLE, argv) is None
    assert lone_process_note(1, {**ACCELERATE_SIMPLE, "WORLD_SIZE": "1"}, argv) is None
    assert lone_process_note(1, {"ACCELERATE_USE_CPU": "True"}, argv) is None
    assert lone_process_note(1, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, argv) is None


def test_accelerate_launch_cpu_with_two_processes_runs_one_and_says_so(tmp_path):
    """The installed accelerate's own launcher: `--cpu --num_processes 2` starts one process, and that process
    reads it from what the launcher left (environment and command line); `--cpu` alone says nothing."""
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("accelerate's launcher not installed")
    probe = tmp_path / "probe.py"
    probe.write_text("from library.train.distributed.distributed import lone_process_note\nprint(lone_process_note(1))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    lines = {}
    for asked in (["--num_processes", "2"], []):
        out = subprocess.run([accelerate, "launch", "--cpu", *asked, "--num_machines", "1", "--mixed_precision",
                              "no", "--dynamo_backend", "no", str(probe)], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        lines[len(asked)] = out.stdout.strip().splitlines()
    assert len(lines[2]) == 1 and lines[2][0].startswith("accelerate launch was asked for 2 processes"), lines
    assert lines[0] == ["None"]


def test_the_trainer_logs_the_note_at_start(tmp_path, monkeypatch, caplog):
    import logging

    for name, value in ACCELERATE_SIMPLE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = dataset(str(tmp_path), n=2)
    trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1))
    with caplog.at_level(logging.WARNING, logger="library.train.trainer"):
        trainer._setup_accelerator()
    notes = [r.getMessage() for r in caplog.records if "accelerate launch was asked for" in r.getMessage()]
    assert len(notes) == 1 and "this run trains as 1 process" in notes[0]


@needs_torchrun
def test_same_seed_same_lora_whatever_the_world_size(tmp_path):
    """2 processes x batch 1 train the LoRA that 1 process x batch 2 trains, at default flags (AdamW, UNet and
    text encoder, two epochs): the plan puts every sample in the same place, its noise and timestep come from its
    own seed, and so does its VAE posterior sample. The 2-process run builds fresh disk caches (each process
    encodes half of the images); the 1-process run caches nothing and encodes every batch as it trains, so the
    latents agree only if an image's posterior sample depends on nothing but the image."""
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp)
    epochs = ["--max_train_epochs", "2"]
    # --lowram: the two processes load the model in turns (barriers at loading; the result must not change)
    launch(tmp, 1, train_args(data, os.path.join(tmp, "out"), os.path.join(tmp, "logs"), steps=8,
                              extra=[*epochs, "--cache_latents", "--cache_latents_to_disk", "--lowram"]),
           audit_roots=[data])
    # each process encoded and wrote the latent caches of its own half of the images
    written = {}
    for r in (0, 1):
        with open(os.path.join(tmp, "audit", f"writes{r}.txt")) as f:  # renames of temporaries to final names
            names = {os.path.basename(line.split(" ", 1)[1]) for line in f.read().splitlines()
                     if line.startswith("os.rename")}
        written[r] = {n for n in names if n.endswith("_sd.npz") and not n.startswith(".")}
    assert len(written[0]) == len(written[1]) == 4 and not written[0] & written[1], written
    single = train_args(data, os.path.join(tmp, "one"), os.path.join(tmp, "logs1"), steps=8, extra=epochs)
    single[single.index("--train_batch_size") + 1] = "2"
    make_trainer(single).run()
    two = load_file(os.path.join(tmp, "out", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert two.keys() == one.keys()
    assert any(k.startswith("lora_te_") for k in one) and any(k.startswith("lora_unet_") for k in one)
    weights = [k for k in one if not k.endswith("alpha")]
    diff = sum(float((two[k].double() - one[k].double()).square().sum()) for k in weights) ** 0.5
    norm = sum(float(one[k].double().square().sum()) for k in weights) ** 0.5
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)  # lora_up starts at 0
    print(f"relative difference {diff / norm:.3g}; largest lora_up weight {moved:.3g}")
    # float32 rounding (summation order), magnified by Adam's division by tiny second moments: measured 6.0e-6
    # here (1 vs 2 threads alone moves it by about 1e-6); with each process drawing its own posterior samples
    # (the code before) it was 7.2e-2
    assert diff / norm <= 5e-5, diff / norm
    assert moved >= 5e-3  # the LoRA trained (8 AdamW steps of lr 1e-3)


@needs_torchrun
def test_fsdp2_full_fine_tune_equals_one_process(tmp_path):
    """fine_tune.py under an FSDP2 accelerate config (the FSDP_* variables accelerate's launcher exports), on 2
    gloo processes x batch 1: each process holds different shards, only rank 0 writes, and the saved model equals
    the one 1 process x batch 2 trains."""
    import torch
    from safetensors.torch import load_file

    from library.cli.entry import build_parser, parse_with_config_file, settings_from_args
    from library.families import get_family
    from library.train.trainer import Trainer

    tmp = str(tmp_path)
    data = dataset(tmp)
    prompts = os.path.join(tmp, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("sks toy --w 64 --h 64 --s 2 --d 5\n")

    def ft_args(out: str, batch: int) -> list[str]:
        return ["--pretrained_model_name_or_path", "tiny:sd1", "--train_data_dir", data, "--caption_extension",
                ".txt", "--resolution", "64", "--train_batch_size", str(batch), "--max_data_loader_n_workers", "0",
                "--cache_latents", "--cache_latents_to_disk", "--optimizer_type", "SGDNesterov",
                "--learning_rate", "0.05", "--max_train_steps", "3", "--seed", "123", "--cpu", "--output_dir", out,
                "--output_name", "model", "--save_model_as", "safetensors", "--logging_dir", os.path.join(tmp, "logs"),
                "--use_ema", "--ema_decay", "0.5",  # the EMA is sharded too; the file holds its gathered weights
                "--sample_prompts", prompts, "--sample_every_n_steps", "3"]  # every process generates, rank 0 writes

    fsdp_env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                "FSDP_RESHARD_AFTER_FORWARD": "true", "SCRIPT": "fine_tune.py"}
    launch(tmp, 1, ft_args(os.path.join(tmp, "out"), 1) + ["--save_state", "--save_every_n_steps", "2"],
           env_extra=fsdp_env)
    trace = read_trace(tmp)
    assert [t["step"] for t in trace[0]] == [1, 2, 3]
    assert all(a["params"] != b["params"] for a, b in zip(trace[0], trace[1]))  # different shards on each
    with open(os.path.join(tmp, "audit", "writes1.txt")) as f:
        assert f.read() == ""  # rank 1 took part in gathering the weights and in sampling but wrote nothing
    assert len(glob.glob(os.path.join(tmp, "out", "sample", "model_000003_00_*.png"))) == 1
    # the state at step 2 holds whole weights and optimizer state; both processes shard it back and step 3 is
    # bitwise the uninterrupted one
    launch(tmp, 1, ft_args(os.path.join(tmp, "resumed"), 1) + ["--resume", os.path.join(tmp, "out",
                                                                 "model-step00000002-state")],
           env_extra=fsdp_env, trace="trace2")
    resumed = read_trace(tmp, "trace2")
    assert [[(t["step"], t["params"]) for t in resumed[r]] for r in (0, 1)] == \
        [[(t["step"], t["params"]) for t in trace[r][2:]] for r in (0, 1)]
    # and the saved model (the EMA weights, whose shards the state also carried) is bitwise the same
    first, again = (load_file(os.path.join(tmp, d, "model.safetensors")) for d in ("out", "resumed"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    family = get_family("sd")
    ns = parse_with_config_file(build_parser("test", family, fine_tune=True), ft_args(os.path.join(tmp, "one"), 2))
    Trainer(family, settings_from_args(ns, family, fine_tune=True)).run()
    two = load_file(os.path.join(tmp, "out", "model.safetensors"))
    one = load_file(os.path.join(tmp, "one", "model.safetensors"))
    assert two.keys() == one.keys() and len(two) > 1000
    unet = [k for k in one if k.startswith("model.diffusion_model.")]
    worst = max((two[k].float() - one[k].float()).abs().max().item() for k in unet)
    print(f"FSDP2 2x1 vs 1x2: largest UNet weight difference {worst:.3g}")
    assert worst <= 1e-5, worst
