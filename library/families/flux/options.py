"""FLUX.1's own options: guidance, T5 length and mask, component files, and the flow-matching scheme.

Declared once here with their help text; library/cli turns them into the sd-scripts flags of the same
names. The memory flags (--blocks_to_swap, --fp8_base, --cpu_offload_checkpointing) are generic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import FlowOptions

T5_MAX_TOKENS = 512  # T5-XXL's tokenizer limit (model_max_length)
COMPONENT_FILE_FLAGS = ("clip_l", "t5xxl", "ae")


@dataclass
class FluxOptions:
    """How captions are encoded, the transformer is called and trained, and where its parts come from."""
    guidance_scale: float = field(default=3.5, metadata={
        "help": "guidance value fed to a guidance-distilled transformer (dev) during training "
                "(sd-scripts' default 3.5; 1.0 is the usual advice for dev LoRAs)"})
    t5xxl_max_token_length: Optional[int] = field(default=None, metadata={
        "help": "T5 tokens per caption (default: 512 for dev, 256 for schnell)"})
    apply_t5_attn_mask: bool = field(default=False, metadata={
        "help": "mask T5 padding in the text encoder and in the transformer's attention"})
    # Separate component files for a BFL single-file transformer (sd-scripts' --clip_l / --t5xxl / --ae).
    clip_l: Optional[str] = field(default=None, metadata={
        "help": "FLUX.1: CLIP-L text encoder file (.safetensors) for a BFL single-file transformer"})
    t5xxl: Optional[str] = field(default=None, metadata={
        "help": "FLUX.1: T5-XXL text encoder file (.safetensors) for a BFL single-file transformer"})
    ae: Optional[str] = field(default=None, metadata={
        "help": "FLUX.1: autoencoder file (ae.safetensors) for a BFL single-file transformer"})
    model_type: str = field(default="flux", metadata={
        "choices": ("flux", "kontext", "chroma"),
        "help": "flux (FLUX.1 dev / schnell), kontext (FLUX.1 Kontext: edit training with control_directory images) "
                "or chroma (Chroma: T5 only, no CLIP-L; needs --apply_t5_attn_mask and "
                "--guidance_scale 0)"})
    flow: FlowOptions = field(default_factory=FlowOptions)

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        length = self.t5xxl_max_token_length
        if length is not None and not (isinstance(length, int) and 1 <= length <= T5_MAX_TOKENS):
            raise ConfigError(f"--t5xxl_max_token_length: expected an integer from 1 to {T5_MAX_TOKENS} "
                              f"(T5-XXL's limit), got {length!r}")
        if not self.guidance_scale >= 0:
            raise ConfigError(f"--guidance_scale: expected a number >= 0, got {self.guidance_scale}")
        self.flow.check()
