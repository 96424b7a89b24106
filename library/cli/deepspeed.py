"""sd-scripts' DeepSpeed flags (`--deepspeed`, `--zero_stage`, ...) -> DeepSpeedOptions (library/train/deepspeed_engine.py)."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

from library.core.errors import ConfigError
from library.train.deepspeed_engine import DeepSpeedOptions, check_options

logger = logging.getLogger(__name__)

DEEPSPEED_FLAGS = ("zero_stage", "offload_optimizer_device", "offload_optimizer_nvme_path", "offload_param_device",
                   "offload_param_nvme_path", "zero3_init_flag", "zero3_save_16bit_model",
                   "fp16_master_weights_and_gradients")


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("DeepSpeed (docs/distributed.md; or launch with an accelerate DeepSpeed config)")
    g.add_argument("--deepspeed", action="store_true",
                   help="train under DeepSpeed ZeRO with the flags below (they replace an accelerate config's)")
    g.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3],
                   help="ZeRO stage: 1 partitions the optimizer states, 2 also the gradients, 3 also the weights")
    g.add_argument("--offload_optimizer_device", type=str, default=None, choices=["cpu", "nvme"],
                   help="keep the optimizer states (and its step) in CPU memory or on NVMe (stages 1-3)")
    g.add_argument("--offload_optimizer_nvme_path", type=str, default=None,
                   help="folder on the NVMe drive for --offload_optimizer_device nvme")
    g.add_argument("--offload_param_device", type=str, default=None, choices=["cpu", "nvme"],
                   help="keep the partitioned weights in CPU memory or on NVMe (stage 3)")
    g.add_argument("--offload_param_nvme_path", type=str, default=None,
                   help="folder on the NVMe drive for --offload_param_device nvme")
    g.add_argument("--zero3_init_flag", action="store_true",
                   help="accepted for sd-scripts compatibility: the model is loaded whole by every process and then "
                        "partitioned (deepspeed.zero.Init is not used)")
    g.add_argument("--zero3_save_16bit_model", action="store_true",
                   help="stage 3: save the gathered 16-bit weights instead of the fp32 master weights")
    g.add_argument("--fp16_master_weights_and_gradients", action="store_true",
                   help="fp16 master weights and gradients in DeepSpeed's optimizer (only stage 2 with "
                        "--offload_optimizer_device cpu and --mixed_precision fp16)")


def deepspeed_options_from_args(ns: argparse.Namespace) -> Optional[DeepSpeedOptions]:
    """The DeepSpeed options of --deepspeed (None without it: a DeepSpeed accelerate launch still trains under it)."""
    if not ns.deepspeed:
        given = [name for name in DEEPSPEED_FLAGS if getattr(ns, name) not in (None, False, 2)]
        if given:
            raise ConfigError(f"--{given[0]}: only used with --deepspeed; add --deepspeed (or launch with an "
                              "accelerate DeepSpeed config and drop the flag)")
        return None
    opts = DeepSpeedOptions(
        zero_stage=ns.zero_stage,
        offload_optimizer_device=ns.offload_optimizer_device or "none",
        offload_optimizer_nvme_path=ns.offload_optimizer_nvme_path,
        offload_param_device=ns.offload_param_device or "none",
        offload_param_nvme_path=ns.offload_param_nvme_path,
        zero3_init_flag=ns.zero3_init_flag,
        zero3_save_16bit_model=ns.zero3_save_16bit_model,
        fp16_master_weights_and_gradients=ns.fp16_master_weights_and_gradients,
    )
    check_options(opts, ns.mixed_precision)
    if opts.zero3_init_flag:
        logger.info("--zero3_init_flag: accepted for sd-scripts compatibility; every process loads the model whole "
                    "and DeepSpeed partitions it when training starts")
    return opts
