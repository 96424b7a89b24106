"""The typed settings of one training run, one dataclass per component, built from flags in library/cli/.

Nothing below library/cli/ sees the argparse namespace: each component takes its own dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional

from library.data.options import DataOptions
from library.families.base import LoadOptions
from library.objectives.losses import LossOptions
from library.objectives.noise import NoiseOptions
from library.train.distributed.deepspeed_engine import DeepSpeedOptions
from library.train.hub import HubOptions
from library.train.memory.compile import CompileOptions
from library.train.memory.memory_setup import MemoryOptions
from library.train.optim.ema import EmaOptions
from library.train.optim.lr_schedulers import SchedulerOptions
from library.train.optim.optimizers import OptimizerOptions
from library.train.speedups import SpeedOptions


@dataclass
class TrainingOptions:
    output_dir: str
    output_name: str
    save_model_as: str = "safetensors"
    save_precision: Optional[str] = None
    save_every_n_epochs: Optional[int] = None
    save_every_n_steps: Optional[int] = None
    save_last_n_epochs: Optional[int] = None
    save_last_n_epochs_state: Optional[int] = None
    save_last_n_steps: Optional[int] = None
    save_last_n_steps_state: Optional[int] = None
    save_state: bool = False
    save_state_on_train_end: bool = False
    resume: Optional[str] = None
    debug_dataset_dir: Optional[str] = None  # --debug_dataset's images (library/train/debug_dataset.py)
    initial_step: Optional[int] = None  # library/train/step_position.py
    initial_epoch: Optional[int] = None
    skip_until_initial_step: bool = False
    max_train_steps: int = 1600
    max_train_epochs: Optional[int] = None
    save_n_epoch_ratio: Optional[int] = None
    seed: int = 0  # a random one is drawn (and recorded in metadata) when --seed is not given
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "no"
    full_fp16: bool = False
    full_bf16: bool = False
    gradient_checkpointing: bool = False
    cpu: bool = False
    logging_dir: Optional[str] = None
    log_with: Optional[str] = None
    log_prefix: Optional[str] = None
    log_tracker_name: Optional[str] = None
    log_tracker_config: dict = field(default_factory=dict)  # {"wandb": {...}, "tensorboard": {...}} init kwargs
    wandb_run_name: Optional[str] = None
    wandb_api_key: Optional[str] = None
    log_config: dict = field(default_factory=dict)  # --log_config: the flags, stored in the tracker
    log_every_n_steps: int = 1
    log_tflops: Optional[int] = None
    compile: CompileOptions = field(default_factory=CompileOptions)  # --torch_compile and the --dynamo_* flags
    highvram: bool = False  # cached parts stay on the device
    lowram: bool = False  # the processes of a machine load the model one after another
    profile_steps: bool = False  # per-step timing breakdown (library/train/observe/profiling.py)
    profile_microbatches: bool = False
    profiler_trace_dir: Optional[str] = None
    profiler_trace_steps: Optional[tuple[int, int]] = None  # (first, last) optimizer step of the trace
    validate_every_n_steps: Optional[int] = None
    validate_every_n_epochs: Optional[int] = None
    max_validation_steps: Optional[int] = None
    ddp_timeout: Optional[int] = None  # minutes (accelerate's InitProcessGroupKwargs); None: PyTorch's default
    ddp_gradient_as_bucket_view: bool = False  # accelerate's DistributedDataParallelKwargs
    ddp_static_graph: bool = False
    context_parallel_size: int = 1  # library/train/distributed/context_parallel.py
    tensor_parallel_size: int = 1  # library/train/distributed/tensor_parallel.py
    ddp_backend: str = "auto"  # "auto", "nccl" or "gloo" (library/train/distributed/distributed.py)
    hub: HubOptions = field(default_factory=HubOptions)  # --huggingface_* (library/train/hub.py)
    deepspeed: Optional[DeepSpeedOptions] = None  # --deepspeed and its flags; None: an accelerate config may ask for it


@dataclass
class NetworkOptions:
    """The network flags in typed form; `network_args` holds the raw key=value strings."""
    network_module: str = "networks.lora"
    network_dim: Optional[int] = 4
    network_alpha: Optional[float] = 1.0
    network_dropout: Optional[float] = None
    network_args: dict[str, str] = field(default_factory=dict)
    network_weights: Optional[str] = None
    dim_from_weights: bool = False
    embeddings: list[str] = field(default_factory=list)  # textual-inversion files whose tokens captions may use
    base_weights: list[str] = field(default_factory=list)
    base_weights_multiplier: list[float] = field(default_factory=list)
    train_unet: bool = True
    train_text_encoder: bool = True
    unet_lr: Optional[float] = None
    text_encoder_lr: Optional[list[float]] = None
    scale_weight_norms: Optional[float] = None
    no_metadata: bool = False
    training_comment: Optional[str] = None
    network_multiplier: float = 1.0
    metadata: dict[str, Optional[str]] = field(default_factory=dict)  # metadata_title, metadata_author, ...


@dataclass
class TextCacheOptions:
    """Whether to encode every caption once before training, and where to keep the outputs."""
    enabled: bool = False
    to_disk: bool = False
    batch_size: int = 1


@dataclass
class TextEncodingOptions:
    """How captions are tokenised and encoded."""
    clip_skip: Optional[int] = None
    max_token_length: Optional[int] = None
    weighted_captions: bool = False  # "(word:1.2)" in training captions (SD, SDXL; library/train/step.py)


@dataclass
class TextualInversionOptions:
    """train_textual_inversion.py / sdxl_train_textual_inversion.py: the new token and how it starts."""
    token_string: str
    init_word: Optional[str] = None
    num_vectors_per_token: int = 1
    use_object_template: bool = False
    use_style_template: bool = False
    weights: Optional[str] = None  # an embedding file to continue from
    metadata: dict[str, Optional[str]] = field(default_factory=dict)  # metadata_title, metadata_author, ...


@dataclass
class FineTuneOptions:
    """A full fine-tune (fine_tune.py, sdxl_train.py, flux_train.py): the model's own weights train."""
    train_text_encoder: bool = False
    learning_rate_te: Optional[float] = None  # every text encoder; None: --learning_rate
    learning_rate_te_each: list[Optional[float]] = field(default_factory=list)  # --learning_rate_te1, _te2 (, _te3)
    train_t5xxl: bool = False  # SD3: --train_text_encoder trains T5-XXL too (the family's fine_tune_t5xxl_encoder)
    mem_eff_save: bool = False  # write checkpoints tensor by tensor, without a second copy in memory
    fused_backward_pass: bool = False  # step each parameter as soon as its gradient is complete
    fused_optimizer_groups: Optional[int] = None  # the same with N groups of parameters
    blockwise_fused_optimizers: bool = False  # the same with one group per block of the family's layout (FLUX.1)
    block_lr: list[float] = field(default_factory=list)  # one rate per denoiser block of the family's layout (SDXL: 23)
    metadata: dict[str, Optional[str]] = field(default_factory=dict)  # metadata_title, metadata_author, ...


@dataclass
class ControlNetOptions:
    """A ControlNet run (train_control_net.py, sdxl_train_control_net.py, flux_train_control_net.py): a ControlNet
    trains beside the frozen model (docs/controlnet.md)."""
    controlnet_model_name_or_path: Optional[str] = None  # a saved ControlNet to go on training
    num_double_blocks: Optional[int] = None  # FLUX.1: blocks copied from the transformer (None: the default)
    num_single_blocks: Optional[int] = None


# A trainer hook: called as hook(trainer, event, step) at "train_start", "step", "epoch" and "train_end".
Hook = Callable[[Any, str, int], None]


@dataclass
class RunSettings:
    """Everything one run needs, each part translated from flags in library/cli/ (and nowhere else)."""
    model: LoadOptions  # model.family_options: the family's own options (its options_type)
    data: DataOptions
    network: Optional[NetworkOptions]  # None for a full fine-tune
    network_kind: Any  # library.train.adapters.network_kinds.NetworkKind of --network_module (chosen once, in the CLI)
    optimizer: OptimizerOptions
    scheduler: SchedulerOptions
    noise: NoiseOptions
    loss: LossOptions
    training: TrainingOptions
    text: TextEncodingOptions = field(default_factory=TextEncodingOptions)
    text_cache: TextCacheOptions = field(default_factory=TextCacheOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    speed: SpeedOptions = field(default_factory=SpeedOptions)
    fine_tune: Optional[FineTuneOptions] = None  # set: train the model's own weights instead of a network
    textual_inversion: Optional[TextualInversionOptions] = None  # set: train new token embeddings only
    controlnet: Optional[ControlNetOptions] = None  # set (with fine_tune): train a ControlNet, the model frozen
    ema: EmaOptions = field(default_factory=EmaOptions)
    zero_terminal_snr: bool = False
    no_half_vae: bool = False
    # The flag values sd-scripts mirrors into ss_* metadata, as the user gave them (library/core/metadata.py
    # RECORDED_FLAGS); only metadata reads them.
    recorded_flags: Mapping[str, Any] = field(default_factory=dict)
    # Every flag's value (secrets left out): a state folder records them, and a resume names the ones that
    # changed (library/train/state.py changed_flags).
    flags: Mapping[str, Any] = field(default_factory=dict)
    hooks: list[Hook] = field(default_factory=list)  # e.g. sampling (library/train/sampling_hook.py)

    def with_seed(self, seed: int) -> "RunSettings":
        """These settings with another run seed everywhere it was copied: the training options, the data options,
        the recorded ss_seed and a --from_scratch initialisation."""
        model = replace(self.model, init_seed=seed) if self.model.from_scratch else self.model
        return replace(self, model=model, data=replace(self.data, seed=seed),
                       training=replace(self.training, seed=seed),
                       recorded_flags={**self.recorded_flags, "seed": seed})
