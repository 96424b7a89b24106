"""--tensor_parallel_size: the frozen denoiser's Linear layers sharded over processes through its diffusers plan,
the LoRA following each shard (library/train/distributed/tensor_parallel.py). Two CPU processes (gloo) train the
FLUX.1 LoRA that one process trains and save the same, whole file; the checks before loading name what is in
the way. Four processes (tp 2 x dp 2) train the LoRA of one process with the global batch."""

from __future__ import annotations

import os

import pytest

from library.core.errors import UserError
from library.families import get_family
from library.train.distributed.tensor_parallel import tensor_parallel_problem
from tests.distributed_helpers import dataset, launch, needs_torchrun, train_args
from tests.test_context_parallel import flux_args
from tests.train_helpers import make_trainer


def test_what_is_in_the_way_is_named_in_one_line():
    ok = dict(has_plan=True, family="flux")
    assert tensor_parallel_problem(2, 2, **ok) is None
    assert tensor_parallel_problem(1, 1, False, "sd", fsdp=True) is None  # off: nothing is checked
    assert tensor_parallel_problem(2, 2, False, "sdxl") == (
        "--tensor_parallel_size 2: sdxl's denoiser has no tensor-parallel plan (FLUX.1, FLUX.2 and Qwen-Image have; "
        "see docs/distributed.md)")
    assert tensor_parallel_problem(2, 4, **ok) is None  # data parallelism over 2 groups of 2
    assert tensor_parallel_problem(4, 8, **ok) is None
    assert tensor_parallel_problem(2, 3, **ok) == (
        "--tensor_parallel_size 2: the 3 process(es) must be a multiple of it (data parallelism runs over groups "
        "of 2)")
    assert tensor_parallel_problem(4, 6, **ok) == (
        "--tensor_parallel_size 4: the 6 process(es) must be a multiple of it (data parallelism runs over groups "
        "of 4)")
    assert tensor_parallel_problem(2, 2, **ok, blocks_to_swap=4) == \
        "--tensor_parallel_size 2: not with --blocks_to_swap"
    assert tensor_parallel_problem(2, 2, **ok, fsdp=True) == "--tensor_parallel_size 2: not with FSDP"
    assert tensor_parallel_problem(2, 2, **ok, deepspeed=True) == "--tensor_parallel_size 2: not with DeepSpeed"
    assert tensor_parallel_problem(2, 2, **ok, compile=True) == "--tensor_parallel_size 2: not with --torch_compile"
    assert tensor_parallel_problem(2, 2, **ok, fp8=True) == (
        "--tensor_parallel_size 2: not with --fp8_base (a float8 / quantized base cannot be sharded)")
    assert tensor_parallel_problem(2, 2, **ok, fine_tune=True) == (
        "--tensor_parallel_size 2: not with a full fine-tune, ControlNet or textual inversion (only a LoRA follows "
        "the sharded base)")
    assert tensor_parallel_problem(2, 2, **ok, cp_size=2) == \
        "--tensor_parallel_size 2: not with --context_parallel_size"
    assert tensor_parallel_problem(2, 2, **ok, ema=True) == "--tensor_parallel_size 2: not with --use_ema"
    assert tensor_parallel_problem(2, 2, **ok, dropout=True) == (
        "--tensor_parallel_size 2: not with LoRA dropout (--network_dropout, rank_dropout, module_dropout: each "
        "process draws its own)")
    assert get_family("flux").facts()["tensor_parallel"] is True and get_family("flux2").facts()["tensor_parallel"]
    assert get_family("qwen_image").facts()["tensor_parallel"] is True
    assert get_family("chroma").facts()["tensor_parallel"] is False
    assert get_family("sd").facts()["tensor_parallel"] is False


def test_a_family_without_a_plan_is_refused_before_training(tmp_path):
    data = dataset(str(tmp_path), n=2)
    trainer = make_trainer(train_args(data, str(tmp_path / "out"), str(tmp_path / "logs"), steps=1,
                                      extra=["--tp_size", "2"]))
    with pytest.raises(UserError, match="^--tensor_parallel_size 2: sd's denoiser has no tensor-parallel plan"):
        trainer.run()
    assert not os.path.exists(tmp_path / "out" / "lora.safetensors")


@pytest.mark.parametrize("extra, message", [
    ([], "the 1 process(es) must be a multiple of it (data parallelism runs over groups of 2)"),
    (["--network_args", "rank_dropout=0.1"], "not with LoRA dropout (--network_dropout, rank_dropout, "
                                             "module_dropout: each process draws its own)"),
    (["--fp8_base"], "not with --fp8_base (a float8 / quantized base cannot be sharded)"),
    (["--blocks_to_swap", "2"], "not with --blocks_to_swap"),
])
def test_flux_runs_that_cannot_shard_are_refused_before_loading(tmp_path, extra, message):
    data = dataset(str(tmp_path), n=2)
    trainer = make_trainer(flux_args(data, str(tmp_path / "out"), steps=1, extra=["--tp_size", "2", *extra]), "flux")
    with pytest.raises(UserError) as err:
        trainer.run()
    assert str(err.value) == f"--tensor_parallel_size 2: {message}"
    assert not os.path.exists(tmp_path / "out")


@needs_torchrun
def test_two_processes_shard_the_base_and_train_the_lora_of_one(tmp_path):
    """2 gloo processes with --tensor_parallel_size 2 (each holds half of every planned Linear and the matching
    half of its LoRA) train one batch at a time and save the LoRA that 1 process trains: same keys, whole
    tensors, values within float32 summation order."""
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp, n=4)
    launch(tmp, 1, flux_args(data, os.path.join(tmp, "tp"), steps=4, extra=["--tensor_parallel_size", "2"]),
           env_extra={"SCRIPT": "flux_train_network.py"}, timeout=300)
    make_trainer(flux_args(data, os.path.join(tmp, "one"), steps=4), "flux").run()
    tp = load_file(os.path.join(tmp, "tp", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert tp.keys() == one.keys() and len(one) == 29 * 3
    assert all(tp[k].shape == one[k].shape for k in one)
    weights = [k for k in one if not k.endswith("alpha")]
    diff = sum(float((tp[k].double() - one[k].double()).square().sum()) for k in weights) ** 0.5
    norm = sum(float(one[k].double().square().sum()) for k in weights) ** 0.5
    worst = max(weights, key=lambda k: float((tp[k].double() - one[k].double()).norm() / one[k].double().norm()))
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)
    print(f"relative difference {diff / norm:.3g}; worst tensor {worst}; largest lora_up weight {moved:.3g}")
    assert diff / norm <= 5e-5, diff / norm
    assert moved >= 1e-3


@needs_torchrun
def test_a_state_of_two_processes_is_whole_and_resumes(tmp_path):
    """--save_state writes the whole LoRA and optimizer state (the shapes one process writes); 2 processes resume
    from the step-2 state and reach the LoRA of the run that went on."""
    import torch
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp, n=4)
    out = os.path.join(tmp, "tp")
    extra = ["--tensor_parallel_size", "2", "--save_state", "--save_every_n_steps", "2"]
    launch(tmp, 1, flux_args(data, out, steps=4, extra=extra), env_extra={"SCRIPT": "flux_train_network.py"},
           timeout=300)
    state = os.path.join(out, "lora-step00000002-state")
    lora = load_file(os.path.join(out, "lora.safetensors"))
    weights = load_file(os.path.join(state, "model.safetensors"))
    assert sorted(tuple(t.shape) for t in weights.values()) == sorted(tuple(t.shape) for t in lora.values())
    optimizer = torch.load(os.path.join(state, "optimizer.bin"), weights_only=False)
    exp_avg = [s["exp_avg"] for s in optimizer["state"].values()]
    assert sorted(tuple(t.shape) for t in exp_avg) == sorted(tuple(t.shape) for k, t in lora.items()
                                                              if not k.endswith("alpha"))
    assert all(type(t) is torch.Tensor for t in exp_avg)  # whole tensors, not DTensors
    launch(tmp, 1, flux_args(data, os.path.join(tmp, "resumed"), steps=4,
                             extra=["--tensor_parallel_size", "2", "--resume", state]),
           env_extra={"SCRIPT": "flux_train_network.py"}, timeout=300)
    resumed = load_file(os.path.join(tmp, "resumed", "lora.safetensors"))
    diff = max(float((resumed[k] - lora[k]).abs().max()) for k in lora)
    print(f"resumed vs straight: largest difference {diff:.3g}")
    assert diff <= 1e-6, diff


OTHER_FAMILIES = {
    "flux2": ("tiny:flux2", "flux2_train_network.py",
              ["--network_module", "networks.lora_flux2", "--qwen3_max_token_length", "16"]),
    "qwen_image": ("tiny:qwen_image", "qwen_image_train_network.py", ["--network_module", "networks.lora_qwen_image"]),
}


@needs_torchrun
@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_flux2_and_qwen_image_shard_through_their_plans_too(tmp_path, family):
    """FLUX.2 [klein] (packed column-wise SwiGLU and fused QKV+MLP Linears) and Qwen-Image (plain column- / row-wise)
    through their own diffusers plans."""
    from safetensors.torch import load_file

    preset, script, flags = OTHER_FAMILIES[family]
    tmp = str(tmp_path)
    data = dataset(tmp, n=4)

    def args(out, extra=()):
        argv = flux_args(data, out, steps=3)
        argv[argv.index("tiny:flux")] = preset
        start = argv.index("--t5xxl_max_token_length")
        return argv[:start] + flags + ["--network_dim", "4", "--network_alpha", "4", "--network_train_unet_only",
                                       *extra]

    launch(tmp, 1, args(os.path.join(tmp, "tp"), ["--tensor_parallel_size", "2"]), env_extra={"SCRIPT": script},
           timeout=300)
    make_trainer(args(os.path.join(tmp, "one")), family).run()
    tp = load_file(os.path.join(tmp, "tp", "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert tp.keys() == one.keys() and all(tp[k].shape == one[k].shape for k in one)
    weights = [k for k in one if not k.endswith("alpha")]
    diff = sum(float((tp[k].double() - one[k].double()).square().sum()) for k in weights) ** 0.5
    norm = sum(float(one[k].double().square().sum()) for k in weights) ** 0.5
    print(f"{family} relative difference {diff / norm:.3g}")
    assert diff / norm <= 5e-5, diff / norm


@needs_torchrun
@pytest.mark.parametrize("split, nproc", [("--tensor_parallel_size", 2), ("--context_parallel_size", 2),
                                         ("--tensor_parallel_size", 4)])
def test_every_process_samples_when_each_forward_needs_all_of_them(tmp_path, split, nproc):
    """Sampling during training runs the split / sharded denoiser: every process takes part (before, context
    parallelism's main process sampled alone and waited for the others until the launch timed out); with 4
    processes, both tensor-parallel groups."""
    tmp = str(tmp_path)
    data = dataset(tmp, n=4)
    prompts = os.path.join(tmp, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("a red cube --w 64 --h 64 --s 2 --d 5\n")
    out = os.path.join(tmp, "out")
    launch(tmp, 1, flux_args(data, out, steps=2, extra=[split, "2", "--sample_prompts", prompts,
                                                        "--sample_every_n_steps", "2"]),
           env_extra={"SCRIPT": "flux_train_network.py"}, timeout=120 * nproc // 2, nproc=nproc)
    samples = sorted(os.listdir(os.path.join(out, "sample")))
    assert len(samples) == 2 and samples[0].startswith("lora_000002_00_") and samples[1] == "lora_000002_grid.png"


@needs_torchrun
def test_four_processes_as_two_groups_of_two_train_the_lora_of_one_process_with_the_global_batch(tmp_path):
    """World 4 = dp 2 x tp 2: a 2-D mesh ("dp", "tp"); each group of 2 shards the base and trains its own share of
    the batches (batch 1), the LoRA gradients averaged over "dp". The saved LoRA (written by global rank 0) is that
    of 1 process with batch 2; a state saved at step 1 resumes on 4 processes to the same LoRA."""
    from safetensors.torch import load_file

    tmp = str(tmp_path)
    data = dataset(tmp, n=4)
    out = os.path.join(tmp, "dptp")
    launch(tmp, 1, flux_args(data, out, steps=2, extra=["--tensor_parallel_size", "2", "--save_state",
                                                        "--save_every_n_steps", "1"]),
           env_extra={"SCRIPT": "flux_train_network.py"}, timeout=600, nproc=4)
    single = flux_args(data, os.path.join(tmp, "one"), steps=2)
    single[single.index("--train_batch_size") + 1] = "2"
    make_trainer(single, "flux").run()
    dptp = load_file(os.path.join(out, "lora.safetensors"))
    one = load_file(os.path.join(tmp, "one", "lora.safetensors"))
    assert dptp.keys() == one.keys() and len(one) == 29 * 3
    assert all(dptp[k].shape == one[k].shape for k in one)
    weights = [k for k in one if not k.endswith("alpha")]
    diff = sum(float((dptp[k].double() - one[k].double()).square().sum()) for k in weights) ** 0.5
    norm = sum(float(one[k].double().square().sum()) for k in weights) ** 0.5
    moved = max(one[k].float().abs().max().item() for k in one if "lora_up" in k)
    print(f"dp 2 x tp 2 vs 1 process of batch 2: relative difference {diff / norm:.3g}; largest lora_up {moved:.3g}")
    assert diff / norm <= 5e-5, diff / norm
    assert moved >= 1e-3
    launch(tmp, 1, flux_args(data, os.path.join(tmp, "resumed"), steps=2,
                             extra=["--tensor_parallel_size", "2", "--resume",
                                    os.path.join(out, "lora-step00000001-state")]),
           env_extra={"SCRIPT": "flux_train_network.py"}, timeout=600, nproc=4)
    resumed = load_file(os.path.join(tmp, "resumed", "lora.safetensors"))
    worst = max(float((resumed[k] - dptp[k]).abs().max()) for k in dptp)
    print(f"resumed vs straight: largest difference {worst:.3g}")
    assert worst <= 1e-6, worst
