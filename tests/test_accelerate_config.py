"""tools/make_accelerate_config.py: every strategy's file read back by accelerate's own launcher and plugins."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import yaml

from tests.distributed_helpers import launch_args, make_accelerate_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _fsdp_plugin(path: str):
    """accelerate's FSDP plugin as a launched process would build it from the file (env set by the launcher)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    env = prepare_multi_gpu_env(launch_args(path))
    fsdp_env = {k: v for k, v in env.items() if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"}
    # sync_module_states asks for the current GPU; there is none here
    with mock.patch.dict(os.environ, fsdp_env), \
            mock.patch("accelerate.utils.dataclasses.is_cuda_available", return_value=True), \
            mock.patch("torch.cuda.current_device", return_value=0):
        return fsdp_env, FullyShardedDataParallelPlugin()


def test_ddp_file_launches_two_processes(tmp_path):
    proc, path = make_accelerate_config(tmp_path, "--strategy", "ddp", "--num_processes", "2", "--gpu_ids", "0,1",
                       "--mixed_precision", "bf16")
    assert proc.returncode == 0, proc.stderr
    args = launch_args(path)
    assert (args.multi_gpu, args.num_processes, args.gpu_ids, args.mixed_precision) == (True, 2, "0,1", "bf16")
    assert not args.use_fsdp and not args.use_deepspeed


def test_two_machines(tmp_path):
    proc, path = make_accelerate_config(tmp_path, "--strategy", "ddp", "--num_processes", "4", "--num_machines", "2",
                       "--machine_rank", "1", "--main_process_ip", "127.0.0.1", "--main_process_port", "29555")
    assert proc.returncode == 0, proc.stderr
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    assert (config["distributed_type"], config["use_cpu"], config["gpu_ids"]) == ("MULTI_GPU", False, "all")
    args = launch_args(path)
    assert (args.num_machines, args.machine_rank, args.main_process_ip, args.main_process_port) == \
        (2, 1, "127.0.0.1", 29555)


def test_fsdp2_family_blocks_reach_the_plugin(tmp_path):
    proc, path = make_accelerate_config(tmp_path, "--strategy", "fsdp2", "--num_processes", "2", "--family", "flux",
                       "--mode", "finetune", "--fsdp_cpu_offload", "--fsdp_activation_checkpointing",
                       "--fsdp_reshard_after_forward", "false")
    assert proc.returncode == 0, proc.stderr
    assert "FluxTransformerBlock,FluxSingleTransformerBlock" in proc.stdout
    env, plugin = _fsdp_plugin(path)
    assert env["FSDP_VERSION"] == "2"
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    assert plugin.transformer_cls_names_to_wrap == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"  # FSDP2 offload (NoOffloadPolicy when off)
    assert plugin.activation_checkpointing is True
    assert str(plugin.state_dict_type) == "StateDictType.FULL_STATE_DICT"


def test_fsdp1_options_reach_the_plugin(tmp_path):
    proc, path = make_accelerate_config(tmp_path, "--strategy", "fsdp1", "--num_processes", "2", "--family", "sdxl",
                       "--fsdp_backward_prefetch", "BACKWARD_POST", "--fsdp_forward_prefetch",
                       "--fsdp_cpu_ram_efficient_loading", "--fsdp_reshard_after_forward", "false")
    assert proc.returncode == 0, proc.stderr
    _, plugin = _fsdp_plugin(path)
    assert plugin.fsdp_version == 1
    assert str(plugin.sharding_strategy) == "ShardingStrategy.SHARD_GRAD_OP"
    assert str(plugin.backward_prefetch) == "BackwardPrefetch.BACKWARD_POST"
    assert plugin.forward_prefetch is True
    assert (plugin.cpu_ram_efficient_loading, plugin.sync_module_states, plugin.use_orig_params) == (True, True, True)
    assert plugin.transformer_cls_names_to_wrap == ["BasicTransformerBlock", "ResnetBlock2D"]


def test_size_based_wrap(tmp_path):
    proc, path = make_accelerate_config(tmp_path, "--strategy", "fsdp2", "--num_processes", "8", "--fsdp_wrap_policy",
                       "SIZE_BASED_WRAP", "--fsdp_min_num_params", "2e7")
    assert proc.returncode == 0, proc.stderr
    env, plugin = _fsdp_plugin(path)
    assert (env["FSDP_AUTO_WRAP_POLICY"], plugin.min_num_params) == ("SIZE_BASED_WRAP", 20_000_000)


def test_deepspeed_zero3_offload(tmp_path):
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    proc, path = make_accelerate_config(tmp_path, "--strategy", "deepspeed", "--num_processes", "2", "--zero_stage", "3",
                       "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu",
                       "--gradient_accumulation_steps", "4")
    assert proc.returncode == 0, proc.stderr
    args = launch_args(path)
    assert args.use_deepspeed
    _, env = prepare_deepspeed_cmd_env(args)
    assert (env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"],
            env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"], env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]) == \
        ("3", "cpu", "cpu", "4")


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "ddp", "--num_processes", "1"], "--strategy ddp: needs at least 2 processes"),
    (["--strategy", "single", "--num_processes", "2"], "--strategy single: one process on one machine"),
    (["--strategy", "ddp", "--num_processes", "2", "--gpu_ids", "0"], "--gpu_ids: 1 GPU(s) listed for 2"),
    (["--strategy", "ddp", "--num_processes", "2", "--gpu_ids", "0,0"], "--gpu_ids: expected distinct"),
    (["--strategy", "fsdp2", "--num_processes", "2"], "give --family"),
    (["--strategy", "fsdp2", "--num_processes", "2", "--family", "nope"], "--family: expected one of"),
    (["--strategy", "fsdp2", "--num_processes", "2", "--family", "sd", "--fsdp_forward_prefetch"],
     "--fsdp_forward_prefetch: an FSDP1 option"),
    (["--strategy", "fsdp1", "--num_processes", "2", "--family", "sd", "--fsdp_use_orig_params", "false"],
     "--fsdp_use_orig_params false: needed on with --mode lora"),
    (["--strategy", "fsdp1", "--num_processes", "2", "--cpu", "--family", "sd"], "--cpu: only with"),
    (["--strategy", "ddp", "--num_processes", "2", "--cpu"], "--cpu --strategy ddp: accelerate starts several CPU"),
    (["--strategy", "deepspeed", "--num_processes", "2", "--offload_param_device", "cpu"],
     "only in ZeRO stage 3"),
    (["--strategy", "ddp", "--num_processes", "4", "--num_machines", "2"], "--main_process_ip"),
    (["--strategy", "ddp", "--num_processes", "2", "--fsdp_min_num_params", "1.5"], "expected a whole number"),
    (["--strategy", "ddp", "--num_processes", "2", "--fsdp_use_orig_params", "maybe"], "expected true or false"),
])
def test_bad_options_one_line_nothing_written(tmp_path, flags, message):
    proc, path = make_accelerate_config(tmp_path, *flags)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not os.path.exists(path)
