"""DeepSpeed ZeRO (stages 0-3, CPU / NVMe offload) for LoRA and full fine-tunes: `deepspeed.initialize` on the StepModule.

A run is under DeepSpeed when sd-scripts' `--deepspeed` flag is given (`--zero_stage`, `--offload_*`, ...; these
then define it) or when `accelerate launch` ran it with a DeepSpeed config (it exports `ACCELERATE_USE_DEEPSPEED`
and `ACCELERATE_DEEPSPEED_*`; a `deepspeed_config_file` of the user's own is read too). Either way accelerate's
`DeepSpeedPlugin` turns them into a DeepSpeed config, whose "auto" values this run fills: the micro-batch size,
the gradient accumulation, the gradient clipping (`--max_grad_norm`) and fp16 / bf16 (`--mixed_precision`); a
value the config fixes that disagrees with the flags is refused in one line.

The engine wraps the `StepModule` (the trained weights with the batch loss as forward, library/train/distributed.py)
and the run's own torch optimizer; the accelerator is left out of DeepSpeed mode, so the loop keeps its own
gradient accumulation groups (`set_gradient_accumulation_boundary`), learning-rate schedule and saving, and the
same code runs on GPUs (NCCL) and on CPU processes (gloo, DeepSpeed's CPU accelerator), where the tests run.
DeepSpeed does the communication: the initial broadcast, gradient reduce(-scatter), parameter all-gathers (ZeRO-3),
clipping by the global norm, fp16 loss scaling.

Saving: model files hold the whole fp32 master weights (DeepSpeed's `safe_get_full_fp32_param`, gathered by every
process, kept by the main one), or with `--zero3_save_16bit_model` on ZeRO-3 the gathered 16-bit weights. A state
folder holds those whole weights and every process's ZeRO optimizer partition (gathered; written by the main
process only); on resume each process loads its own with DeepSpeed's `load_state_dict`, which restores the fp32
masters and the model weights from them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from library.core.errors import ConfigError, UserError
from library.train.distributed import gather_objects

logger = logging.getLogger(__name__)

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
INSTALL = "DS_BUILD_OPS=0 pip install deepspeed"


@dataclass
class DeepSpeedOptions:
    """sd-scripts' DeepSpeed flags (library/deepspeed_utils.py there), checked by library/cli/deepspeed.py."""

    zero_stage: int = 2
    offload_optimizer_device: str = "none"
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_device: str = "none"
    offload_param_nvme_path: Optional[str] = None
    zero3_init_flag: bool = False
    zero3_save_16bit_model: bool = False
    fp16_master_weights_and_gradients: bool = False


def check_options(o: DeepSpeedOptions, mixed_precision: str) -> None:
    """One line naming the first combination DeepSpeed cannot run (before anything loads)."""
    if o.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero_stage: expected 0, 1, 2 or 3, got {o.zero_stage}")
    for name in ("offload_optimizer_device", "offload_param_device"):
        device = getattr(o, name)
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(f"--{name}: expected one of {', '.join(OFFLOAD_DEVICES)}, got {device!r}")
        path = getattr(o, name.replace("_device", "_nvme_path"))
        if device == "nvme" and not path:
            raise ConfigError(f"--{name} nvme: needs --{name.replace('_device', '_nvme_path')} (a folder on the NVMe "
                              "drive)")
    if o.offload_param_device != "none" and o.zero_stage != 3:
        raise ConfigError(f"--offload_param_device {o.offload_param_device}: parameters are sharded (and offloadable) "
                          f"only in ZeRO stage 3, got --zero_stage {o.zero_stage}")
    if o.offload_optimizer_device != "none" and o.zero_stage < 1:
        raise ConfigError(f"--offload_optimizer_device {o.offload_optimizer_device}: needs --zero_stage 1, 2 or 3 "
                          "(stage 0 does not partition the optimizer)")
    if o.fp16_master_weights_and_gradients and not (o.zero_stage == 2 and o.offload_optimizer_device == "cpu"
                                                    and mixed_precision == "fp16"):
        raise ConfigError("--fp16_master_weights_and_gradients: DeepSpeed supports it only with --zero_stage 2, "
                          "--offload_optimizer_device cpu and --mixed_precision fp16")


def deepspeed_installed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def launched_with_deepspeed() -> bool:
    """Whether accelerate's launcher ran this process with a DeepSpeed config (distributed_type DEEPSPEED)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() == "true"


@contextlib.contextmanager
def accelerate_without_deepspeed() -> Iterator[None]:
    """Inside, accelerate does not see a DeepSpeed launch: the Accelerator made here does plain data parallel (the
    process group, the device, autocast) and leaves the model and optimizer to the engine made below."""
    saved = os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = saved


class ZeroConfig:
    """The DeepSpeed config of this run: accelerate's DeepSpeedPlugin made from the flags (or, without --deepspeed,
    from the accelerate launch's environment), then the run's own values filled in by `complete`."""

    def __init__(self, options: Optional[DeepSpeedOptions], cpu: bool = False):
        if cpu:  # --cpu on a machine with a GPU: DeepSpeed picks its accelerator when it is first imported
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if not deepspeed_installed():
            raise UserError(f"DeepSpeed: the deepspeed package is not installed ({INSTALL})")
        from accelerate.utils import DeepSpeedPlugin

        self.from_flags = options is not None
        try:
            if options is None:  # everything from ACCELERATE_DEEPSPEED_* (and a deepspeed_config_file)
                plugin = DeepSpeedPlugin()
            else:
                o = options
                plugin = DeepSpeedPlugin(
                    hf_ds_config="none",  # the flags define it, as in sd-scripts
                    zero_stage=o.zero_stage, offload_optimizer_device=o.offload_optimizer_device,
                    offload_optimizer_nvme_path=o.offload_optimizer_nvme_path or "none",
                    offload_param_device=o.offload_param_device,
                    offload_param_nvme_path=o.offload_param_nvme_path or "none",
                    zero3_init_flag=o.zero3_init_flag, zero3_save_16bit_model=o.zero3_save_16bit_model,
                    gradient_accumulation_steps="auto", gradient_clipping="auto")
        except (ValueError, OSError) as e:
            raise ConfigError(f"DeepSpeed config: {str(e).splitlines()[0]}") from None
        self.plugin = plugin
        self.config: dict = plugin.deepspeed_config
        self.options = options or DeepSpeedOptions()
        self.stage = int(self.config.get("zero_optimization", {}).get("stage", 0))
        self.save_16bit = bool(plugin.zero3_save_16bit_model) and self.stage == 3
        if self.options.fp16_master_weights_and_gradients:
            self.config.setdefault("fp16", {})["fp16_master_weights_and_grads"] = True

    def describe(self) -> str:
        z = self.config.get("zero_optimization", {})
        offload = {k: z.get(f"offload_{k}", {}).get("device", "none") for k in ("optimizer", "param")}
        return (f"ZeRO stage {self.stage}, optimizer offload {offload['optimizer']}, parameter offload "
                f"{offload['param']}, from {'the --deepspeed flags' if self.from_flags else 'the accelerate config'}")

    def complete(self, micro_batch: int, accumulation: int, world_size: int, max_grad_norm: Optional[float],
                 mixed_precision: str, client_optimizer: bool) -> dict:
        """The config with this run's values in place of "auto"; a value the config fixes otherwise is refused."""
        values = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": accumulation,
            "train_batch_size": micro_batch * accumulation * world_size,
            "gradient_clipping": float(max_grad_norm or 0.0),
        }
        flags = {"train_micro_batch_size_per_gpu": "--train_batch_size",
                 "gradient_accumulation_steps": "--gradient_accumulation_steps",
                 "train_batch_size": "--train_batch_size x processes x --gradient_accumulation_steps",
                 "gradient_clipping": "--max_grad_norm"}
        for key, value in values.items():
            given = self.config.get(key, "auto")
            if given in ("auto", None):
                self.config[key] = value
            elif float(given) != float(value):
                raise ConfigError(f"DeepSpeed config {key} = {given}: this run has {value} ({flags[key]}); set it to "
                                  f"\"auto\" or give the same value")
        try:
            self.plugin.set_mixed_precision(mixed_precision)
        except ValueError as e:
            raise ConfigError(f"DeepSpeed config: {e} (--mixed_precision {mixed_precision})") from None
        if self.config.get("fp16", {}).get("enabled") is True:
            self.config["fp16"].setdefault("initial_scale_power", 0)  # as sd-scripts: a first scale of 1 avoids overflows
        # The run's own optimizer (any --optimizer_type) trains; DeepSpeed would otherwise refuse it as untested or,
        # with offload, insist on its compiled CPU Adam.
        if client_optimizer:
            self.config["zero_allow_untested_optimizer"] = True
            self.config["zero_force_ds_cpu_optimizer"] = False
        fp16 = self.config.get("fp16", {})
        if fp16.get("enabled") is True and fp16.get("auto_cast"):
            fp16["auto_cast"] = False  # the loss computes its own precision (autocast); the batch stays as it is
        return self.config


def unsupported(stage: int, s) -> Optional[str]:
    """Why these RunSettings cannot train under DeepSpeed (refused in one line before anything loads), or None."""
    ft, t = s.fine_tune, s.training
    if ft and (ft.fused_backward_pass or ft.fused_optimizer_groups or ft.blockwise_fused_optimizers):
        return ("--fused_backward_pass / --fused_optimizer_groups / --blockwise_fused_optimizers step parameters "
                "inside backward; DeepSpeed steps its own partitioned optimizer")
    if s.memory.blocks_to_swap:
        return "--blocks_to_swap is not supported with it (use --offload_param_device cpu with --zero_stage 3)"
    if t.compile.torch_compile:
        return "--torch_compile is not supported with it yet"
    if os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() == "true":
        return "the launch also asks for FSDP (ACCELERATE_USE_FSDP); choose one"
    if "schedulefree" in s.optimizer.optimizer_type.lower():  # train()/eval() swap weights DeepSpeed keeps apart
        return f"--optimizer_type {s.optimizer.optimizer_type}: schedule-free optimizers are not supported with it"
    if s.ema.use_ema:  # the saved file would hold the masters, not the averages swapped into the model
        return "--use_ema is not supported with it yet"
    return None


def _disable_cpu_shm_build() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce the first time a process group starts (minutes
    of C++ compiling); gloo, which the process group already uses, does the same job. Not built on CPU."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


class ZeroEngine:
    """The DeepSpeed engine around a StepModule and its optimizer, as the loop and the saver use it."""

    def __init__(self, step_module: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict, stage: int,
                 save_16bit: bool):
        import deepspeed

        _disable_cpu_shm_build()
        if not torch.distributed.is_initialized():  # one process, started without a launcher: a group of one
            from deepspeed.accelerator import get_accelerator

            torch.distributed.init_process_group(get_accelerator().communication_backend_name(),
                                                 store=torch.distributed.HashStore(), rank=0, world_size=1)
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(name, value)  # what a launcher exports; DeepSpeed reads LOCAL_RANK
        self.stage, self.save_16bit = stage, save_16bit
        # fp16 / bf16: the model holds 16-bit copies, the optimizer the fp32 masters that are saved
        self.sixteen_bit = any(config.get(k, {}).get("enabled") is True for k in ("fp16", "bf16"))
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=step_module, optimizer=optimizer,
                                                                 config=config, dist_init_required=False)
        self.trained = step_module.trained

    def __call__(self, batch, generator):
        return self.engine(batch, generator)

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        """Backward of one micro-batch (`loss` already divided by the accumulation); `sync`: the group's last one,
        where DeepSpeed reduces the gradients."""
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, lr_scheduler) -> None:
        """The optimizer step of a gradient accumulation group: clip by the global norm, step, zero; then the schedule."""
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        lr_scheduler.step()

    def full_shapes(self) -> dict[str, torch.Size]:
        """The trained tensors' whole shapes by name (ZeRO-3 holds partitions; their ds_shape is the whole one)."""
        params = dict(self.trained.named_parameters())
        return {k: torch.Size(getattr(params.get(k), "ds_shape", v.shape)) for k, v in self.trained.state_dict().items()}

    # --- whole weights for saving ------------------------------------------------------------------------------
    def _whole_values(self, params: list[torch.nn.Parameter], keep: bool) -> list[Optional[torch.Tensor]]:
        """The whole values of `params` (on the CPU where `keep`); a collective: every process calls it alike. In 16-bit
        training the fp32 masters (DeepSpeed's safe_get_full_fp32_param, one by one), unless --zero3_save_16bit_model;
        otherwise the model's own copies, which equal them, all-gathered together (ZeRO-3; whole already below)."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        if self.sixteen_bit and not self.save_16bit:
            out = []
            for p in params:
                full = safe_get_full_fp32_param(p) if p.requires_grad else None
                if full is None:  # frozen: no master
                    with deepspeed.zero.GatheredParameters([p]):
                        full = p.data.float()
                out.append(full.detach().cpu().clone() if keep else None)
            return out
        with deepspeed.zero.GatheredParameters(params):
            return [p.data.detach().cpu().clone() if keep else None for p in params]

    @contextlib.contextmanager
    def gathered(self, keep: bool, chunk_elements: int = 1 << 26) -> Iterator[None]:
        """Inside, the trained module's parameters hold their whole values where `keep` (the process that saves);
        every process must enter. Gathered in chunks of at most `chunk_elements` elements (a few collectives, and
        never the whole model at once on every process)."""
        entries = [(sub, name, p) for sub in self.trained.modules() for name, p in sub._parameters.items()
                   if p is not None]
        chunks, current, size = [], [], 0
        for entry in entries:
            numel = getattr(entry[2], "ds_numel", entry[2].numel())
            if current and size + numel > chunk_elements:
                chunks.append(current)
                current, size = [], 0
            current.append(entry)
            size += numel
        if current:
            chunks.append(current)
        swapped = []
        with torch.no_grad():
            for chunk in chunks:
                for (sub, name, p), whole in zip(chunk, self._whole_values([e[2] for e in chunk], keep)):
                    if keep:
                        sub._parameters[name] = torch.nn.Parameter(whole.to(p.device), requires_grad=False)
                        swapped.append((sub, name, p))
        try:
            yield
        finally:
            for sub, name, p in swapped:
                sub._parameters[name] = p

    def whole_weights(self) -> dict[str, torch.Tensor]:
        """The trained module's whole weights by name (fp32 masters; every process must call it)."""
        keep = self.engine.global_rank == 0
        with self.gathered(keep):
            return {k: v.detach().cpu() for k, v in self.trained.state_dict().items()} if keep else {}

    # --- state folders -----------------------------------------------------------------------------------------
    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(whole weights, every process's ZeRO optimizer partition by rank) for a state folder; every process calls
        it, the main process gets the result."""
        weights = self.whole_weights()
        partitions = gather_objects(self.optimizer.state_dict())
        return weights, {"deepspeed_zero_stage": self.stage, "partitions": partitions}

    def load_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict) -> None:
        """Restore a state folder on every process: its own optimizer partition (fp32 masters included), then the
        model weights from those masters (DeepSpeed's load_state_dict)."""
        saved = optimizer_state.get("deepspeed_zero_stage") if isinstance(optimizer_state, dict) else None
        if saved is None:
            raise UserError("--resume: this state was not saved under DeepSpeed (its optimizer state is not ZeRO "
                            "partitions); resume it without DeepSpeed, or start a new run")
        if saved != self.stage:
            raise UserError(f"--resume: the state was saved under ZeRO stage {saved}, this run uses stage "
                            f"{self.stage}; resume with the same stage")
        if self.stage < 3:  # the model copies; stage 3 restores its partitions from the fp32 masters itself
            self.trained.load_state_dict({k: v.to(self.engine.device) for k, v in weights.items()}, strict=True)
        self.optimizer.load_state_dict(optimizer_state["partitions"], load_optimizer_states=True,
                                       load_from_fp32_weights=True)
