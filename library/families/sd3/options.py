"""SD3 / SD3.5's own options: component files, T5 length, attention masks, caption dropout per encoder,
SD3.5's scaled position embeddings, and the timestep scheme (library/objectives/flow_sd3.py).

Declared once here with their help text; library/cli turns them into the sd-scripts flags of the same
names (sd3_train_utils.add_sd3_training_arguments). The memory flags (--blocks_to_swap, --fp8_base) are generic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow_sd3 import SD3FlowOptions

T5_MAX_TOKENS = 512
COMPONENT_FILE_FLAGS = ("clip_l", "clip_g", "t5xxl")


@dataclass
class SD3Options:
    """How captions are encoded, the MMDiT is called and trained, and where its parts come from."""
    clip_l: Optional[str] = field(default=None, metadata={
        "help": "SD3: CLIP-L text encoder file (.safetensors); default: the one inside the checkpoint"})
    clip_g: Optional[str] = field(default=None, metadata={
        "help": "SD3: CLIP-G text encoder file (.safetensors); default: the one inside the checkpoint"})
    t5xxl: Optional[str] = field(default=None, metadata={
        "help": "SD3: T5-XXL text encoder file (.safetensors); default: the one inside the checkpoint"})
    t5xxl_device: Optional[str] = field(default=None, metadata={
        "help": "accepted for sd-scripts compatibility, where it is marked [DOES NOT WORK]: T5-XXL runs with the "
                "other text encoders"})
    t5xxl_dtype: Optional[str] = field(default=None, metadata={
        "help": "accepted for sd-scripts compatibility, where it is marked [DOES NOT WORK]: T5-XXL takes the "
                "run's dtype"})
    save_clip: bool = field(default=False, metadata={
        "help": "accepted for sd-scripts compatibility, where it is marked [DOES NOT WORK] (no unified checkpoint)"})
    save_t5xxl: bool = field(default=False, metadata={
        "help": "accepted for sd-scripts compatibility, where it is marked [DOES NOT WORK] (no unified checkpoint)"})
    num_last_block_to_freeze: Optional[int] = field(default=None, metadata={
        "help": "sd3_train.py: freeze the last N joint transformer blocks of the MMDiT (sd-scripts freezes the last "
                "N parameters of them; docs/sd3_train_network.md)"})
    t5xxl_max_token_length: int = field(default=256, metadata={
        "help": "T5 tokens per caption (sd-scripts' default 256)"})
    apply_lg_attn_mask: bool = field(default=False, metadata={
        "help": "mask CLIP-L / CLIP-G padding in their attention"})
    apply_t5_attn_mask: bool = field(default=False, metadata={
        "help": "mask T5 padding in its attention"})
    clip_l_dropout_rate: float = field(default=0.0, metadata={
        "help": "probability of zeroing a caption's CLIP-L outputs (and mask) during training"})
    clip_g_dropout_rate: float = field(default=0.0, metadata={
        "help": "probability of zeroing a caption's CLIP-G outputs (and mask) during training"})
    t5_dropout_rate: float = field(default=0.0, metadata={
        "help": "probability of zeroing a caption's T5 outputs (and mask) during training"})
    enable_scaled_pos_embed: bool = field(default=False, metadata={
        "help": "SD3.5 medium: position embeddings scaled to each training resolution (multi-resolution training)"})
    pos_emb_random_crop_rate: float = field(default=0.0, metadata={
        "help": "SD3.5 medium: probability of a random (not centred) crop of the position embeddings"})
    flow: SD3FlowOptions = field(default_factory=SD3FlowOptions)

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        length = self.t5xxl_max_token_length
        if not (isinstance(length, int) and 1 <= length <= T5_MAX_TOKENS):
            raise ConfigError(f"--t5xxl_max_token_length: expected an integer from 1 to {T5_MAX_TOKENS} "
                              f"(T5-XXL's limit), got {length!r}")
        for flag in ("clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate", "pos_emb_random_crop_rate"):
            value = getattr(self, flag)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"--{flag}: expected a number from 0 to 1, got {value}")
        self.flow.check()
