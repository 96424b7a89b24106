"""Lumina Image 2.0's own options: component files, Gemma-2 token length, system prompt and the flow-matching scheme.

Declared once here with their help text; library/cli turns them into sd-scripts' flags of the same names
(lumina_train_util.add_lumina_train_arguments).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import TIMESTEP_SAMPLINGS, FlowOptions

MAX_TOKENS = 8192  # Gemma-2's max_position_embeddings
DEFAULT_TOKENS = 256  # sd-scripts' strategy_lumina: --gemma2_max_token_length omitted -> 256
SYSTEM_PROMPT_MARK = "<Prompt Start>"  # what sd-scripts puts between the system prompt and the caption
# The flags naming Lumina's parts beside the DiT file (the tools take them too).
COMPONENT_FILE_FLAGS = ("gemma2", "ae")


# sd-scripts' Lumina samplers: FLUX.1's plus nextdit_shift (uniform σ, then FLUX.1's shift by image size).
LUMINA_TIMESTEP_SAMPLINGS = (*TIMESTEP_SAMPLINGS, "nextdit_shift")


@dataclass
class LuminaFlowOptions(FlowOptions):
    """FLUX.1's flow-matching flags with sd-scripts' Lumina defaults: `shift` sampling with shift 6.0."""
    timestep_sampling: str = field(default="shift", metadata={
        "choices": LUMINA_TIMESTEP_SAMPLINGS,
        "help": "how σ is drawn: shift (default: sigmoid then --discrete_flow_shift), sigma, uniform, sigmoid, "
                "flux_shift (sigmoid, shifted by image size) or nextdit_shift (uniform, shifted by image size)"})
    discrete_flow_shift: float = field(default=6.0, metadata={
        "help": "shift of the schedule for --timestep_sampling shift and sigma (default 6.0; > 1: noisier)"})

    def check(self) -> None:
        """As FLUX.1's, with nextdit_shift accepted too."""
        if self.timestep_sampling == "nextdit_shift":
            FlowOptions.check(dataclasses.replace(self, timestep_sampling="uniform"))
            return
        if self.timestep_sampling not in LUMINA_TIMESTEP_SAMPLINGS:
            raise ConfigError(f"--timestep_sampling: expected one of {', '.join(LUMINA_TIMESTEP_SAMPLINGS)}, "
                              f"got {self.timestep_sampling!r}")
        super().check()


@dataclass
class LuminaOptions:
    """Where Lumina's parts come from, how captions are tokenized, and how the model trains."""
    gemma2: Optional[str] = field(default=None, metadata={
        "help": "Lumina: Gemma-2 2B text encoder, one .safetensors file (gemma_2_2b_fp16.safetensors) or a "
                "transformers folder"})
    ae: Optional[str] = field(default=None, metadata={
        "help": "Lumina: the FLUX.1 autoencoder file (ae.safetensors)"})
    gemma2_max_token_length: Optional[int] = field(default=None, metadata={
        "help": "Gemma-2 tokens per caption (default 256)"})
    system_prompt: str = field(default="", metadata={
        "help": "Lumina: system prompt put before every caption, followed by '<Prompt Start> ' (default: none)"})
    use_flash_attn: bool = field(default=False, metadata={
        "help": "sd-scripts: Flash Attention in its own NextDiT; here PyTorch SDPA is used (a warning says so)"})
    use_sage_attn: bool = field(default=False, metadata={
        "help": "sd-scripts: Sage Attention in its own NextDiT; here PyTorch SDPA is used (a warning says so)"})
    flow: LuminaFlowOptions = field(default_factory=LuminaFlowOptions)

    @property
    def max_tokens(self) -> int:
        return DEFAULT_TOKENS if self.gemma2_max_token_length is None else self.gemma2_max_token_length

    def prompt_prefix(self) -> str:
        """What goes before each caption: `<system prompt> <Prompt Start> `, or nothing (as sd-scripts)."""
        return f"{self.system_prompt} {SYSTEM_PROMPT_MARK} " if self.system_prompt else ""

    def ignored_flags(self) -> list[str]:
        return [f"--{name}" for name in ("use_flash_attn", "use_sage_attn") if getattr(self, name)]

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        value = self.gemma2_max_token_length
        if value is not None and not (isinstance(value, int) and 1 <= value <= MAX_TOKENS):
            raise ConfigError(f"--gemma2_max_token_length: expected an integer from 1 to {MAX_TOKENS}, got {value!r}")
        self.flow.check()
