"""What a ControlNet run trains: a ControlNet beside the frozen model (the family builds and saves it:
ModelFamily.create_controlnet / save_controlnet). The model reads it from Components.controlnet in `predict`."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from library.families.base import Components, ModelFamily
from library.train import checkpoints as ckpt
from library.train.adapters.network_setup import SAVE_DTYPES
from library.train.adapters.trainables import Trainable
from library.train.settings import ControlNetOptions

logger = logging.getLogger(__name__)


class ControlNetTrainable(Trainable):
    """`module` is {"controlnet": the ControlNet} (a ModuleDict, so FSDP shards it as a fine-tune's parts)."""

    is_adapter = False
    saves_whole_model = False
    train_text_encoder = False
    trained_encoders = frozenset()

    def __init__(self, family: ModelFamily, components: Components, opts: ControlNetOptions, save_model_as: str,
                 save_precision: Optional[str], *, full_dtype: torch.dtype, device: torch.device,
                 gradient_checkpointing: bool):
        self.family, self.components, self.opts = family, components, opts
        self.save_model_as, self.save_precision = save_model_as, save_precision
        controlnet = family.create_controlnet(components, opts.controlnet_model_name_or_path, opts.num_double_blocks,
                                             opts.num_single_blocks)
        if opts.controlnet_model_name_or_path:
            logger.info("ControlNet loaded from %s", opts.controlnet_model_name_or_path)
        controlnet.to(device, full_dtype)
        controlnet.requires_grad_(True)
        controlnet.train()
        if gradient_checkpointing and hasattr(controlnet, "enable_gradient_checkpointing"):
            controlnet.enable_gradient_checkpointing()
        components.controlnet = controlnet
        self.module = nn.ModuleDict({"controlnet": controlnet})

    def parameter_groups(self, default_lr):
        params = [p for p in self.module.parameters() if p.requires_grad]
        return [{"params": params, "lr": default_lr}], ["controlnet"]

    def shape_settings(self):
        return {"controlnet": type(self.module["controlnet"]).__name__,
                "num_double_blocks": self.opts.num_double_blocks, "num_single_blocks": self.opts.num_single_blocks}

    def file_path(self, output_dir, stem):
        return ckpt.model_path(output_dir, stem, self.save_model_as)

    def save(self, path, metadata):
        self.family.save_controlnet(self.module["controlnet"], path, self.save_model_as,
                                    SAVE_DTYPES[self.save_precision], metadata)
