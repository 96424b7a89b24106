"""What a run trains, behind one interface: adapter weights over a frozen model, or the model's own weights.

The loop asks a `Trainable` for its parameter groups, its weights (for the state), a save of the
result and a few per-step hooks; it never asks which kind it has. `AdapterTrainable` wraps a
--network_module network; `ModelTrainable` trains the denoiser and/or text encoders themselves
(fine_tune.py, sdxl_train.py, flux_train.py).
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from torch import nn

from library.core.errors import ConfigError
from library.families.base import Components, ModelFamily
from library.train import checkpoints as ckpt
from library.train.adapters.network_kinds import NetworkKind, build_network, text_encoders_arg
from library.train.adapters.network_setup import (
    SAVE_DTYPES,
    load_network_weights,
    optimizer_groups,
    save_network,
    trained_text_encoders,
)
from library.train.settings import FineTuneOptions, NetworkOptions

logger = logging.getLogger(__name__)


class Trainable(ABC):
    """The trained weights of a run. `module` is what accelerate prepares and the optimizer steps."""

    module: nn.Module
    engine = None  # a ZeroEngine (library/train/distributed/deepspeed_engine.py) holding the weights' and optimizer's partitions
    is_adapter: bool
    saves_whole_model: Optional[bool] = None  # whether a save writes the whole model (None: not is_adapter)
    train_text_encoder: bool  # whether any text encoder's output depends on trained weights
    trained_encoders: frozenset[int]  # which text encoders those are (their outputs are never cached)

    @abstractmethod
    def parameter_groups(self, default_lr: float) -> tuple[list[dict], list[str]]:
        """Optimizer parameter groups and their names (for the lr logs)."""

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained tensors, by name: what a state folder stores and restores (under FSDP this process's
        pieces of them)."""
        if self.sharded and hasattr(self.sharding, "local_state"):
            return self.sharding.local_state(self.module)
        return self.module.state_dict()

    def full_shapes(self) -> dict[str, torch.Size]:
        """The trained tensors' whole shapes, by name (what a resumed state is checked against; an FSDP1 process
        holds flat pieces of them, a ZeRO-3 process partitions)."""
        if self.engine is not None:
            return self.engine.full_shapes()
        if self.sharded and hasattr(self.sharding, "full_shapes"):
            return self.sharding.full_shapes(self.module)
        return {name: t.shape for name, t in self.weights().items()}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(weights, strict=True)

    @property
    def weights_partitioned(self) -> bool:
        """Whether every process must take part in running the model (ZeRO-3 gathers the weights as it runs)."""
        return self.engine is not None and self.engine.stage == 3

    def shape_settings(self) -> dict[str, Any]:
        """The settings that fix the trained tensors' shapes; a resume with others is refused by name."""
        return {}

    @abstractmethod
    def file_path(self, output_dir: str, stem: str) -> str:
        """Where a save under `stem` goes (a file, or a folder for diffusers formats)."""

    @abstractmethod
    def save(self, path: str, metadata: dict[str, str]) -> None:
        """Write the trained result to `path` (atomically)."""

    # Set by the trainer when FSDP shards the trained weights: library/train/distributed/sharding.py's Fsdp2, or
    # sharding_fsdp1.py's Fsdp1 (how to gather them whole and to save / load a whole state).
    sharding: Any = None

    @property
    def sharded(self) -> bool:
        return self.sharding is not None

    def gathered(self, keep: bool):
        """Entered by every process before saving: sharded weights whole where `keep` (the saving process)."""
        if self.engine is not None:
            return self.engine.gathered(keep)
        return self.sharding.gathered(self.module, keep) if self.sharded else contextlib.nullcontext()

    def state_for_saving(self, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """(weights, optimizer state) as a state folder stores them; called on every process (FSDP / ZeRO gather)."""
        if self.engine is not None:
            return self.engine.full_state()
        if self.sharded:
            return self.sharding.full_state(self.module, optimizer)
        return self.weights(), optimizer.state_dict()

    def restore(self, weights: dict[str, torch.Tensor], optimizer, optimizer_state: dict) -> None:
        """Load a state folder's weights and optimizer state (every process)."""
        if self.engine is not None:
            self.engine.load_state(weights, optimizer_state)
            return
        if self.sharded:
            return self.sharding.load_full_state(self.module, optimizer, weights, optimizer_state)
        self.load_weights(weights)
        optimizer.load_state_dict(optimizer_state)

    def on_epoch_start(self) -> None:
        """Called before each epoch's first batch."""

    def before_optimizer_step(self) -> None:
        """Called once the step's gradients are final (clipped), just before the optimizer step."""

    def after_optimizer_step(self, device: torch.device) -> dict[str, float]:
        """Called after each optimizer step; returns values to log."""
        return {}


class AdapterTrainable(Trainable):
    """A --network_module network (LoRA, LyCORIS, ...) over a frozen model."""

    is_adapter = True

    def __init__(self, kind: NetworkKind, family: ModelFamily, components: Components, opts: NetworkOptions,
                 save_model_as: str, save_precision: Optional[str], *, fp8_base: bool, full_dtype: torch.dtype,
                 device: torch.device, gradient_checkpointing: bool):
        self.kind, self.family, self.components, self.opts = kind, family, components, opts
        self.save_model_as, self.save_precision = save_model_as, save_precision
        network = build_network(kind, family, components, opts, fp8_base=fp8_base)
        te = text_encoders_arg(components)
        network.apply_to(te, components.denoiser, opts.train_text_encoder, opts.train_unet)
        self.name_map = kind.name_map(family, components)
        if opts.network_weights:  # also with --dim_from_weights: the file gave the shapes, now its values
            info = load_network_weights(network, family, opts.network_weights, self.name_map)
            logger.info("loaded network weights from %s: %s", opts.network_weights, info)
        self.train_text_encoder = opts.train_text_encoder
        self.trained_encoders = trained_text_encoders(network, components) if opts.train_text_encoder else frozenset()
        network.to(device, full_dtype)
        if gradient_checkpointing and hasattr(network, "enable_gradient_checkpointing"):
            network.enable_gradient_checkpointing()
        if hasattr(network, "prepare_grad_etc"):
            network.prepare_grad_etc(te, components.denoiser)
        self.module = network

    @contextlib.contextmanager
    def adapter_off(self):
        """The base model's own output inside the block (the network at multiplier 0), for differential output
        preservation (library/train/step.py); the multiplier it had is set back after."""
        before = getattr(self.module, "multiplier", 1.0)
        self.module.set_multiplier(0.0)
        try:
            yield
        finally:
            self.module.set_multiplier(before)

    def before_predict(self, batch: dict) -> None:
        """A network conditioned on an image (ControlNet-LLLite: `set_cond_image`) gets the batch's conditioning
        images at the images' pixel size, in [-1, 1] as sd-scripts' LLLite dataset and ComfyUI's loader give them
        (the batch holds them in [0, 1])."""
        if not hasattr(self.module, "set_cond_image"):
            return
        images = batch.get("conditioning_images")
        if images is None:
            raise ConfigError(f"--network_module {self.opts.network_module}: the batch has no conditioning images; "
                              "expected a conditioning_data_dir for every subset")
        self.module.set_cond_image(images * 2.0 - 1.0)

    def parameter_groups(self, default_lr):
        return optimizer_groups(self.module, self.opts, default_lr, self.kind, self.components)

    def shape_settings(self):
        o = self.opts
        return {"network_module": o.network_module, "network_dim": o.network_dim,
                "network_args": dict(sorted(o.network_args.items()))}

    def file_path(self, output_dir, stem):
        return ckpt.model_path(output_dir, stem, self.save_model_as)

    def save(self, path, metadata):
        save_network(self.module, path, self.save_precision, metadata, self.name_map)

    def on_epoch_start(self):
        if hasattr(self.module, "on_epoch_start"):
            self.module.on_epoch_start(text_encoders_arg(self.components), self.components.denoiser)

    def before_optimizer_step(self):
        if getattr(self.module, "ggpo", False):  # LoRA-GGPO, in sd-scripts' order: gradient norms, then weight norms
            self.module.update_grad_norms()
            self.module.update_norms()

    def after_optimizer_step(self, device):
        if not self.opts.scale_weight_norms:
            return dict(self.module.ggpo_logs()) if getattr(self.module, "ggpo", False) else {}
        keys_scaled, mean_norm, max_norm = self.module.apply_max_norm_regularization(self.opts.scale_weight_norms,
                                                                                     device)
        return {"max_norm/keys_scaled": keys_scaled, "max_norm/average_key_norm": mean_norm,
                "max_norm/max_key_norm": max_norm}


def fine_tune_plan(opts: FineTuneOptions, learning_rate: float, num_text_encoders: int) -> dict[str, float]:
    """The parts a full fine-tune trains and their learning rates: {"denoiser": lr, "text_encoder1": lr, ...}.

    As sd-scripts: the denoiser trains unless --learning_rate is 0; a text encoder trains with
    --train_text_encoder unless its own rate (--learning_rate_te / _te1 / _te2, else the base rate) is 0.
    """
    plan = {}
    if learning_rate:
        plan["denoiser"] = learning_rate
    if opts.train_text_encoder:
        each = list(opts.learning_rate_te_each)
        for i, value in enumerate(each):
            if value is not None and i >= num_text_encoders:
                raise ConfigError(f"--learning_rate_te{i + 1}: the model has {num_text_encoders} text encoder(s)")
        for i in range(num_text_encoders):
            lr = each[i] if i < len(each) and each[i] is not None else opts.learning_rate_te
            lr = learning_rate if lr is None else lr
            if lr:
                plan[f"text_encoder{i + 1}"] = lr
    if not plan:
        raise ConfigError("nothing to train: --learning_rate is 0 and no text encoder trains "
                          "(add --train_text_encoder with a non-zero --learning_rate_te)")
    return plan


class ModelTrainable(Trainable):
    """The model's own weights: the denoiser and/or text encoders, as `fine_tune_plan` says."""

    is_adapter = False

    def __init__(self, family: ModelFamily, components: Components, plan: dict[str, float], opts: FineTuneOptions,
                 save_model_as: str, save_precision: Optional[str], *, device: torch.device,
                 gradient_checkpointing: bool):
        self.family, self.components, self.plan, self.opts = family, components, plan, opts
        self.save_model_as, self.save_precision = save_model_as, save_precision
        parts = {"denoiser": components.denoiser}
        parts.update({f"text_encoder{i + 1}": te for i, te in enumerate(components.text_encoders)})
        self.module = nn.ModuleDict({name: parts[name] for name in plan})
        self.trained_encoders = frozenset(i for i in range(len(components.text_encoders))
                                          if f"text_encoder{i + 1}" in plan)
        self.train_text_encoder = bool(self.trained_encoders)
        for name, part in self.module.items():
            part.requires_grad_(True)
            part.train()
            if name != "denoiser" and gradient_checkpointing and hasattr(part, "gradient_checkpointing_enable"):
                part.gradient_checkpointing_enable()

    def parameter_groups(self, default_lr):
        groups, names = [], []
        for name, part in self.module.items():
            if name == "denoiser" and self.opts.block_lr:
                block_groups = self._block_groups(part)
                groups += [g for g, _ in block_groups]
                names += [n for _, n in block_groups]
                continue
            family_groups = self.family.denoiser_parameter_groups(self.components, self.plan[name]) \
                if name == "denoiser" else None
            if family_groups is not None:
                for group_name, params, lr in family_groups:
                    if not lr:
                        for p in params:
                            p.requires_grad_(False)
                    elif params:
                        groups.append({"params": params, "lr": lr})
                        names.append(f"denoiser {group_name}")
                continue
            params = [p for p in part.parameters() if p.requires_grad]
            if params:
                groups.append({"params": params, "lr": self.plan[name]})
                names.append(name)
        return groups, names

    def _block_groups(self, denoiser: nn.Module) -> list[tuple[dict, str]]:
        """--block_lr: one group per block of the family's layout; a block at rate 0 is frozen.

        A parameter's block is that of its module's kohya LoRA name (the family's targets rename
        module paths to the original layout, e.g. SDXL's input_blocks / middle_block / output_blocks).
        """
        layout = self.family.lora_block_layout()
        target = next(t for t in self.family.lora_targets(self.components) if t.root is denoiser)
        by_block: dict[int, list] = {}
        for path, p in denoiser.named_parameters():
            module = path.rsplit(".", 1)[0]
            renamed = target.rename(module) if target.rename else module
            index = layout.index_of(f"{target.prefix}_{renamed.replace('.', '_')}")
            if index < 0:
                raise ConfigError(f"--block_lr: {path} belongs to no block of {self.family.name}'s layout")
            by_block.setdefault(index, []).append(p)
        out = []
        for index in sorted(by_block):
            lr = self.opts.block_lr[index]
            if lr:
                out.append(({"params": by_block[index], "lr": lr}, f"denoiser block {index}"))
            else:
                for p in by_block[index]:
                    p.requires_grad_(False)
        return out

    def optimizer_blocks(self) -> dict[int, str]:
        """--blockwise_fused_optimizers: {id(parameter): block}. The denoiser's blocks are the family's
        (`ModelFamily.optimizer_block`: FLUX.1's double_blocks.<i>, single_blocks.<i>, other); each trained
        text encoder is one block of its own."""
        out = {}
        for name, part in self.module.items():
            for path, p in part.named_parameters():
                block = self.family.optimizer_block(path) if name == "denoiser" else None
                if name == "denoiser" and block is None:
                    raise ConfigError(f"--blockwise_fused_optimizers: {self.family.name} has no block layout for it")
                out[id(p)] = f"denoiser {block}" if block else name
        return out

    def shape_settings(self):
        return {"trained_parts": sorted(self.plan)}

    def file_path(self, output_dir, stem):
        return ckpt.model_path(output_dir, stem, self.save_model_as)

    def save(self, path, metadata):
        self.family.save_model(self.components, path, self.save_model_as, SAVE_DTYPES[self.save_precision],
                               metadata, mem_eff=self.opts.mem_eff_save)
