"""FLUX.2's own options: component files, Qwen3 token length and the flow-matching scheme.

Declared once here with their help text; library/cli turns them into flags of the same names (musubi-tuner's
flux_2_train_network.py spells the text encoder --text_encoder; here it is --qwen3, as Z-Image's, since
--text_encoder is taken by other tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import FlowOptions

MAX_TOKENS = 40960  # Qwen3's max_position_embeddings
DEFAULT_TOKENS = 512  # Flux2KleinPipeline's max_sequence_length
# The flags naming FLUX.2's parts beside the DiT file (the tools take them too).
COMPONENT_FILE_FLAGS = ("qwen3", "ae")


@dataclass
class Flux2FlowOptions(FlowOptions):
    """FLUX.2 training defaults: σ = sigmoid of a normal draw, shifted by image size (`--timestep_sampling
    flux_shift`, the closest of this project's samplings to musubi-tuner's flux2_shift, see docs/flux2.md), no
    loss weighting; the prediction is the model's own (raw)."""
    timestep_sampling: str = field(default="flux_shift", metadata={
        "choices": FlowOptions.__dataclass_fields__["timestep_sampling"].metadata["choices"],
        "help": "how σ is drawn: flux_shift (default: sigmoid, shifted by image size, as musubi-tuner's FLUX.2 "
                "setting), shift (sigmoid then --discrete_flow_shift), sigma, uniform or sigmoid"})
    weighting_scheme: str = field(default="none", metadata={
        "choices": FlowOptions.__dataclass_fields__["weighting_scheme"].metadata["choices"],
        "help": "density of σ for --timestep_sampling sigma (default none, as musubi-tuner's FLUX.2 setting)"})


@dataclass
class Flux2Options:
    """Where FLUX.2's parts come from, how captions are tokenized, and how the model trains."""
    qwen3: Optional[str] = field(default=None, metadata={
        "help": "FLUX.2 klein: Qwen3 text encoder (Qwen3-4B for klein 4B, Qwen3-8B for 9B), one .safetensors file "
                "(ComfyUI's qwen_3_4b.safetensors) or a transformers folder"})
    ae: Optional[str] = field(default=None, metadata={
        "help": "FLUX.2: the 32-channel FLUX.2 autoencoder file (flux2-vae.safetensors)"})
    qwen3_max_token_length: Optional[int] = field(default=None, metadata={
        "help": "FLUX.2: Qwen3 tokens per caption, chat template included (default 512, as diffusers' pipeline)"})
    flow: Flux2FlowOptions = field(default_factory=Flux2FlowOptions)

    @property
    def max_tokens(self) -> int:
        return DEFAULT_TOKENS if self.qwen3_max_token_length is None else self.qwen3_max_token_length

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        value = self.qwen3_max_token_length
        if value is not None and not (isinstance(value, int) and 16 <= value <= MAX_TOKENS):
            raise ConfigError(f"--qwen3_max_token_length: expected an integer from 16 to {MAX_TOKENS}, "
                              f"got {value!r}")
        self.flow.check()
