"""Qwen-Image's own options: component files, musubi-tuner's memory switches and the flow-matching scheme, declared
once with their help text; library/cli turns them into the flags of qwen_image_train_network.py (musubi-tuner's
names where it has them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import FlowOptions

# The flags naming Qwen-Image's parts beside the DiT (the tools take them too; --vae is the common flag).
COMPONENT_FILE_FLAGS = ("text_encoder", "model_version", "edit", "edit_plus")  # the version: tools take it too
DEFAULT_FLOW_SHIFT = 2.2  # musubi-tuner's documented Qwen-Image setting (docs/qwen_image.md)
# musubi-tuner's --model_version values (original = Qwen-Image; the edit models read control images)
MODEL_VERSIONS = ("original", "edit", "edit-2509", "edit-2511")
EDIT_VERSIONS = MODEL_VERSIONS[1:]


@dataclass
class QwenImageFlowOptions(FlowOptions):
    """The flow-matching flags with musubi-tuner's Qwen-Image defaults: `shift` sampling (sigmoid of a normal, then
    shifted by 2.2), raw velocity prediction."""
    timestep_sampling: str = field(default="shift", metadata={
        "choices": FlowOptions.__dataclass_fields__["timestep_sampling"].metadata["choices"],
        "help": "how σ is drawn (default shift: sigmoid of a normal, shifted by --discrete_flow_shift, as "
                "musubi-tuner's Qwen-Image training)"})
    discrete_flow_shift: float = field(default=DEFAULT_FLOW_SHIFT, metadata={
        "help": f"shift of the schedule for --timestep_sampling shift and sigma (default {DEFAULT_FLOW_SHIFT})"})


@dataclass
class QwenImageOptions:
    """Where Qwen-Image's parts come from and musubi-tuner's switches of its script."""
    model_version: str = field(default="original", metadata={
        "choices": MODEL_VERSIONS,
        "help": "musubi-tuner's name: original (Qwen-Image), edit (Qwen-Image-Edit, 1 control image), edit-2509 / "
                "edit-2511 (Qwen-Image-Edit-2509 / -2511, 1-3 control images): edit training reads each image's "
                "control image(s) from the dataset's control_directory"})
    edit: bool = field(default=False, metadata={
        "help": "musubi-tuner's older switch for Qwen-Image-Edit: as --model_version edit"})
    edit_plus: bool = field(default=False, metadata={
        "help": "musubi-tuner's older switch for Qwen-Image-Edit-2509: as --model_version edit-2509"})
    text_encoder: Optional[str] = field(default=None, metadata={
        "help": "Qwen-Image: Qwen2.5-VL-7B file (ComfyUI's qwen_2.5_vl_7b.safetensors; its language model is used) "
                "or a transformers folder; not needed with a diffusers folder"})
    fp8_scaled: bool = field(default=False, metadata={
        "help": "musubi-tuner: scaled float8 DiT weights; here the DiT's frozen weights are stored as float8 "
                "(as --fp8_base_unet)"})
    fp8_vl: bool = field(default=False, metadata={
        "help": "musubi-tuner: float8 Qwen2.5-VL; here Qwen2.5-VL keeps the run's dtype (a warning says so)"})
    flow: QwenImageFlowOptions = field(default_factory=QwenImageFlowOptions)

    @property
    def version(self) -> str:
        """--model_version, or what musubi-tuner's older --edit / --edit_plus switches name."""
        if self.model_version != "original":
            return self.model_version
        return "edit-2509" if self.edit_plus else "edit" if self.edit else "original"

    @property
    def is_edit(self) -> bool:
        """Whether this is a Qwen-Image-Edit run (control images, the vision tower)."""
        return self.version in EDIT_VERSIONS

    @property
    def max_controls(self) -> int:
        """Control images a sample may have: 1 for Qwen-Image-Edit, 3 for -2509 / -2511, none for Qwen-Image."""
        return {"edit": 1, "edit-2509": 3, "edit-2511": 3}.get(self.version, 0)

    def ignored_flags(self) -> list[str]:
        """The musubi-tuner switches given that change nothing here."""
        return ["--fp8_vl"] if self.fp8_vl else []

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        given = [f for f, on in (("--edit", self.edit), ("--edit_plus", self.edit_plus),
                                 (f"--model_version {self.model_version}", self.model_version != "original")) if on]
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)}: they name the model version twice; give --model_version only")
        self.flow.check()
