"""Z-Image's own options: component files, Qwen3 token length and the flow-matching scheme.

Declared once here with their help text; library/cli turns them into flags of the same names (musubi-tuner's
zimage_train_network.py spells the text encoder --text_encoder; here it is --qwen3, as the FLUX.1 family's --t5xxl,
since --text_encoder is taken by other tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import FlowOptions

MAX_TOKENS = 40960  # Qwen3's max_position_embeddings
DEFAULT_TOKENS = 512  # diffusers' ZImagePipeline max_sequence_length, musubi-tuner's DEFAULT_MAX_SEQUENCE_LENGTH
# The flags naming Z-Image's parts beside the DiT file (the tools take them too).
COMPONENT_FILE_FLAGS = ("qwen3", "ae")


@dataclass
class ZImageFlowOptions(FlowOptions):
    """musubi-tuner's Z-Image training defaults (docs/zimage.md there): `--timestep_sampling shift
    --weighting_scheme none --discrete_flow_shift 2.0`; the prediction is the model's own (raw)."""
    timestep_sampling: str = field(default="shift", metadata={
        "choices": FlowOptions.__dataclass_fields__["timestep_sampling"].metadata["choices"],
        "help": "how σ is drawn: shift (default: sigmoid then --discrete_flow_shift, as musubi-tuner), sigma, "
                "uniform, sigmoid or flux_shift (sigmoid, shifted by image size)"})
    discrete_flow_shift: float = field(default=2.0, metadata={
        "help": "shift of the schedule for --timestep_sampling shift and sigma (default 2.0, musubi-tuner's Z-Image "
                "setting; > 1: noisier)"})
    weighting_scheme: str = field(default="none", metadata={
        "choices": FlowOptions.__dataclass_fields__["weighting_scheme"].metadata["choices"],
        "help": "density of σ for --timestep_sampling sigma (default none, as musubi-tuner's Z-Image setting)"})


@dataclass
class ZImageOptions:
    """Where Z-Image's parts come from, how captions are tokenized, and how the model trains."""
    qwen3: Optional[str] = field(default=None, metadata={
        "help": "Z-Image: Qwen3-4B text encoder, one .safetensors file (ComfyUI's qwen_3_4b.safetensors) or a "
                "transformers folder"})
    ae: Optional[str] = field(default=None, metadata={
        "help": "Z-Image: the FLUX.1 autoencoder file (ae.safetensors)"})
    qwen3_max_token_length: Optional[int] = field(default=None, metadata={
        "help": "Z-Image: Qwen3 tokens per caption, chat template included (default 512, as diffusers' pipeline)"})
    sample_shift: float = field(default=3.0, metadata={
        "help": "Z-Image: flow shift of the sampling schedule (default 3.0, the scheduler config Tongyi-MAI ships)"})
    flow: ZImageFlowOptions = field(default_factory=ZImageFlowOptions)

    @property
    def max_tokens(self) -> int:
        return DEFAULT_TOKENS if self.qwen3_max_token_length is None else self.qwen3_max_token_length

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        value = self.qwen3_max_token_length
        if value is not None and not (isinstance(value, int) and 16 <= value <= MAX_TOKENS):
            raise ConfigError(f"--qwen3_max_token_length: expected an integer from 16 to {MAX_TOKENS} (the chat "
                              f"template takes 14 tokens), got {value!r}")
        if not self.sample_shift > 0:
            raise ConfigError(f"--sample_shift: expected a number > 0, got {self.sample_shift!r}")
        self.flow.check()
