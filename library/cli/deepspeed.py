"""sd-scripts' DeepSpeed flags (`--deepspeed`, `--zero_stage`, ...) -> DeepSpeedOptions (library/train/deepspeed_engine.py)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

from library.cli.options import Range, flag, flag_specs, settings_from
from library.core.errors import ConfigError
from library.train.deepspeed_engine import DeepSpeedOptions, check_options

logger = logging.getLogger(__name__)

@dataclass
class DeepSpeedFlags:
    flag_group: ClassVar[str] = "DeepSpeed (docs/distributed.md; or launch with an accelerate DeepSpeed config)"
    deepspeed: bool = flag(False, "train under DeepSpeed ZeRO with the flags below (they replace an accelerate "
                                  "config's)")
    zero_stage: int = flag(2, "ZeRO stage: 1 partitions the optimizer states, 2 also the gradients, 3 also the "
                              "weights",
                              choices=(0, 1, 2, 3), range=Range(0, 3, integer=True, note="DeepSpeed ZeRO stage"))
    offload_optimizer_device: Optional[str] = flag(None, "keep the optimizer states (and its step) in CPU memory or "
                                                         "on NVMe (stages 1-3)", choices=("cpu", "nvme"))
    offload_optimizer_nvme_path: Optional[str] = flag(None, "folder on the NVMe drive for --offload_optimizer_device "
                                                            "nvme")
    offload_param_device: Optional[str] = flag(None, "keep the partitioned weights in CPU memory or on NVMe (stage 3)",
                                                     choices=("cpu", "nvme"))
    offload_param_nvme_path: Optional[str] = flag(None, "folder on the NVMe drive for --offload_param_device nvme")
    zero3_init_flag: bool = flag(False, "accepted for sd-scripts compatibility: the model is loaded whole by every "
                                        "process and then partitioned (deepspeed.zero.Init is not used)")
    zero3_save_16bit_model: bool = flag(False, "stage 3: save the gathered 16-bit weights instead of the fp32 master "
                                               "weights")
    fp16_master_weights_and_gradients: bool = flag(False, "fp16 master weights and gradients in DeepSpeed's optimizer"
                                                          " (only stage 2 with --offload_optimizer_device cpu and "
                                                          "--mixed_precision fp16)")


def deepspeed_options_from_args(ns: argparse.Namespace) -> Optional[DeepSpeedOptions]:
    """The DeepSpeed options of --deepspeed (None without it: a DeepSpeed accelerate launch still trains under it)."""
    if not ns.deepspeed:
        given = [spec.name for spec in flag_specs(DeepSpeedFlags)
                 if spec.name != "deepspeed" and getattr(ns, spec.name) != spec.default]
        if given:
            raise ConfigError(f"--{given[0]}: only used with --deepspeed; add --deepspeed (or launch with an "
                              "accelerate DeepSpeed config and drop the flag)")
        return None
    opts = settings_from(DeepSpeedOptions, ns, offload_optimizer_device=ns.offload_optimizer_device or "none",
                         offload_param_device=ns.offload_param_device or "none")
    check_options(opts, ns.mixed_precision)
    if opts.zero3_init_flag:
        logger.info("--zero3_init_flag: accepted for sd-scripts compatibility; every process loads the model whole "
                    "and DeepSpeed partitions it when training starts")
    return opts
