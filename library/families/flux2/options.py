"""FLUX.2's own options: component files, text token lengths, dev's guidance value, the model version and the
flow-matching scheme.

Declared once here with their help text; library/cli turns them into flags of the same names (musubi-tuner's
flux_2_train_network.py spells the text encoder --text_encoder; here it is --qwen3, as Z-Image's, since
--text_encoder is taken by other tools; FLUX.2 [dev]'s Mistral-Small-3.1 is --mistral3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import FlowOptions

MAX_TOKENS = 40960  # Qwen3's max_position_embeddings
MISTRAL_MAX_TOKENS = 131072  # Mistral-Small-3.1's max_position_embeddings
DEFAULT_TOKENS = 512  # Flux2KleinPipeline's and Flux2Pipeline's max_sequence_length
# The flags naming FLUX.2's parts beside the DiT file (the tools take them too).
COMPONENT_FILE_FLAGS = ("qwen3", "mistral3", "ae")
# musubi-tuner's --model_version values (flux2_utils.FLUX2_MODEL_INFO): dev has Mistral text and guidance
MODEL_VERSIONS = ("dev", "klein-4b", "klein-base-4b", "klein-9b", "klein-base-9b")
# musubi-tuner's name of the size-shifted sampling; here it is flux_shift on the unpatchified latents (same σ)
MUSUBI_FLUX2_SHIFT = "flux2_shift"


@dataclass
class Flux2FlowOptions(FlowOptions):
    """FLUX.2 training defaults: σ = sigmoid of a normal draw, shifted by image size (`--timestep_sampling
    flux_shift`, the closest of this project's samplings to musubi-tuner's flux2_shift, see docs/flux2.md), no
    loss weighting; the prediction is the model's own (raw)."""
    timestep_sampling: str = field(default="flux_shift", metadata={
        "choices": (*FlowOptions.__dataclass_fields__["timestep_sampling"].metadata["choices"], MUSUBI_FLUX2_SHIFT),
        "help": "how σ is drawn: flux_shift (default: sigmoid, shifted by image size: musubi-tuner's flux2_shift, "
                "which is accepted as the same), shift (sigmoid then --discrete_flow_shift), sigma, uniform or "
                "sigmoid"})
    weighting_scheme: str = field(default="none", metadata={
        "choices": FlowOptions.__dataclass_fields__["weighting_scheme"].metadata["choices"],
        "help": "density of σ for --timestep_sampling sigma (default none, as musubi-tuner's FLUX.2 setting)"})

    def check(self) -> None:
        # musubi-tuner's flux2_shift: μ from its 2x2-patched latents' h·w is flux_shift's μ from (h/2)·(w/2) of
        # these unpatchified ones (the same token count): the same σ, recorded under this project's name.
        if self.timestep_sampling == MUSUBI_FLUX2_SHIFT:
            self.timestep_sampling = "flux_shift"
        super().check()


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
    mistral3: Optional[str] = field(default=None, metadata={
        "help": "FLUX.2 [dev]: Mistral-Small-3.1 text encoder, a .safetensors file (the first shard of FLUX.2-dev's "
                "text_encoder/, the others beside it) or a transformers Mistral3 folder"})
    mistral3_max_token_length: Optional[int] = field(default=None, metadata={
        "help": "FLUX.2 [dev]: Mistral tokens per caption, system prompt and chat template included (default 512, "
                "as diffusers' Flux2Pipeline)"})
    guidance_scale: float = field(default=1.0, metadata={
        "help": "FLUX.2 [dev]: guidance value fed to its guidance embedding during training (default 1.0, as "
                "musubi-tuner); klein has no guidance embedding"})
    model_version: Optional[str] = field(default=None, metadata={
        "choices": MODEL_VERSIONS,
        "help": "FLUX.2 model, as musubi-tuner names it: checked against the files (dev: Mistral text and guidance; "
                "klein: Qwen3) and sets the sampling defaults (dev, klein-base-*: 50 steps, guidance 4; klein-4b / "
                "-9b: 4 steps, 1); default: read from the files"})
    flow: Flux2FlowOptions = field(default_factory=Flux2FlowOptions)

    @property
    def max_tokens(self) -> int:
        return DEFAULT_TOKENS if self.qwen3_max_token_length is None else self.qwen3_max_token_length

    @property
    def mistral_max_tokens(self) -> int:
        return DEFAULT_TOKENS if self.mistral3_max_token_length is None else self.mistral3_max_token_length

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        for flag, value, top in (("qwen3_max_token_length", self.qwen3_max_token_length, MAX_TOKENS),
                                 ("mistral3_max_token_length", self.mistral3_max_token_length, MISTRAL_MAX_TOKENS)):
            if value is not None and not (isinstance(value, int) and 16 <= value <= top):
                raise ConfigError(f"--{flag}: expected an integer from 16 to {top}, got {value!r}")
        if not self.guidance_scale >= 0:
            raise ConfigError(f"--guidance_scale: expected a number >= 0, got {self.guidance_scale}")
        if self.model_version is not None and self.model_version not in MODEL_VERSIONS:
            raise ConfigError(f"--model_version: expected one of {', '.join(MODEL_VERSIONS)}, "
                              f"got {self.model_version!r}")
        if self.qwen3 and self.mistral3:
            raise ConfigError("--qwen3 and --mistral3: give one (--qwen3 for klein, --mistral3 for dev)")
        self.flow.check()
