"""Write an accelerate config file for one multi-process strategy (single, ddp, fsdp1, fsdp2, deepspeed).

    python tools/make_accelerate_config.py --strategy ddp --num_processes 2 --mixed_precision bf16 --output ddp.yaml
    python tools/make_accelerate_config.py --strategy fsdp2 --num_processes 4 --family flux --mode finetune \\
        --fsdp_cpu_ram_efficient_loading --output fsdp2.yaml
    accelerate launch --config_file ddp.yaml sdxl_train_network.py --config_file job.toml

Strategies and options: docs/distributed.md. The web UI calls this tool for its "Multi-GPU Optimization" page.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    from library.cli.accelerate_config import (
        BACKWARD_PREFETCH,
        MIXED_PRECISIONS,
        MODES,
        OFFLOAD_DEVICES,
        STRATEGIES,
        STRATEGY_HELP,
        WRAP_POLICIES,
    )
    from library.cli.parser import TrainingArgumentParser

    # one-line errors with the closest flag names, exit 2 (as the training scripts)
    p = TrainingArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="strategies:\n" + "\n".join(f"  {k}: {v}" for k, v in STRATEGY_HELP.items()))
    p.add_argument("--strategy", required=True, choices=STRATEGIES)
    p.add_argument("--output", required=True, help="the YAML file to write (atomically)")
    p.add_argument("--num_processes", type=int, default=1, help="processes in all (over every machine)")
    p.add_argument("--gpu_ids", default=None, help="GPUs of this machine to use, e.g. 0,1 (default: all)")
    p.add_argument("--mixed_precision", default="no", choices=MIXED_PRECISIONS)
    p.add_argument("--cpu", action="store_true", help="processes on the CPU (single or ddp only)")
    p.add_argument("--family", default=None, help="model family (sd, sdxl, flux, ...): FSDP wraps its blocks")
    p.add_argument("--mode", default="lora", choices=MODES, help="what the job trains (LoRA needs use_orig_params)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="DeepSpeed needs it in its config")
    g = p.add_argument_group("several machines")
    g.add_argument("--num_machines", type=int, default=1)
    g.add_argument("--machine_rank", type=int, default=0)
    g.add_argument("--main_process_ip", default=None)
    g.add_argument("--main_process_port", type=int, default=None)
    g = p.add_argument_group("FSDP (fsdp1, fsdp2)")
    g.add_argument("--fsdp_cpu_offload", action="store_true", help="keep sharded weights in CPU memory")
    g.add_argument("--fsdp_reshard_after_forward", type=_bool, default=True, metavar="true|false",
                   help="free gathered weights after each block's forward (false: SHARD_GRAD_OP, more memory)")
    g.add_argument("--fsdp_activation_checkpointing", action="store_true",
                   help="FSDP's activation checkpointing of the wrapped blocks")
    g.add_argument("--fsdp_cpu_ram_efficient_loading", action="store_true",
                   help="rank 0 loads the weights, the others receive them (turns on sync_module_states)")
    g.add_argument("--fsdp_backward_prefetch", default=None, choices=BACKWARD_PREFETCH, help="FSDP1")
    g.add_argument("--fsdp_forward_prefetch", action="store_true", help="FSDP1")
    g.add_argument("--fsdp_use_orig_params", type=_bool, default=True, metavar="true|false",
                   help="required with LoRA (frozen and trained weights in one block)")
    g.add_argument("--fsdp_limit_all_gathers", type=_bool, default=True, metavar="true|false")
    g.add_argument("--fsdp_wrap_policy", default="TRANSFORMER_BASED_WRAP", choices=WRAP_POLICIES)
    g.add_argument("--fsdp_transformer_layer_cls", default=None,
                   help="block classes to wrap, comma-separated (default: the family's)")
    g.add_argument("--fsdp_min_num_params", type=float, default=1e8, help="SIZE_BASED_WRAP: parameters per unit")
    g = p.add_argument_group("DeepSpeed")
    g.add_argument("--zero_stage", type=int, default=2, choices=(1, 2, 3))
    g.add_argument("--offload_optimizer_device", default="none", choices=OFFLOAD_DEVICES)
    g.add_argument("--offload_param_device", default="none", choices=OFFLOAD_DEVICES)
    return p


def run(argv=None) -> None:
    from library.cli.accelerate_config import LaunchSettings, write

    args = vars(build_parser().parse_args(argv))
    output = args.pop("output")
    if float(args["fsdp_min_num_params"]) != int(args["fsdp_min_num_params"]):
        from library.core.errors import ConfigError

        raise ConfigError(f"--fsdp_min_num_params: expected a whole number, got {args['fsdp_min_num_params']}")
    args["fsdp_min_num_params"] = int(args["fsdp_min_num_params"])
    settings = LaunchSettings(**args)
    config = write(settings, output)
    for note in settings.notes:
        print(note)
    print(f"wrote {output} ({config['distributed_type']}, {config['num_processes']} process(es)); run:\n"
          f"  accelerate launch --config_file {output} <script>.py --config_file <job>.toml")


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
