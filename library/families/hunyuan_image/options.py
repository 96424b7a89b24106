"""HunyuanImage 2.1's own options: component files, sd-scripts' memory / attention switches and the flow-matching
scheme, declared once with their help text; library/cli turns them into the flags of sd-scripts'
hunyuan_image_train_network.py (same names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import FlowOptions

# The flags naming HunyuanImage's parts beside the DiT file (the tools take them too; --vae is the common flag).
COMPONENT_FILE_FLAGS = ("text_encoder", "byt5")
ATTN_MODES = ("torch", "xformers", "flash", "sageattn", "sdpa")


@dataclass
class HunyuanImageFlowOptions(FlowOptions):
    """The flow-matching flags with sd-scripts' HunyuanImage defaults: sigma sampling, shift 5.0, raw prediction."""
    discrete_flow_shift: float = field(default=5.0, metadata={
        "help": "shift of the schedule for --timestep_sampling sigma and shift (default 5.0; > 1: noisier)"})


@dataclass
class HunyuanImageOptions:
    """Where HunyuanImage's parts come from and sd-scripts' switches of its script."""
    text_encoder: Optional[str] = field(default=None, metadata={
        "help": "HunyuanImage: Qwen2.5-VL-7B file (qwen_2.5_vl_7b.safetensors; its language model is used)"})
    byt5: Optional[str] = field(default=None, metadata={
        "help": "HunyuanImage: glyph byT5 file (byt5_small_glyphxl_fp16.safetensors)"})
    fp8_scaled: bool = field(default=False, metadata={
        "help": "sd-scripts: scaled float8 DiT weights; here the DiT's frozen weights are stored as float8 "
                "(as --fp8_base_unet)"})
    fp8_vl: bool = field(default=False, metadata={
        "help": "sd-scripts: float8 Qwen2.5-VL; here Qwen2.5-VL keeps the run's dtype (a warning says so)"})
    text_encoder_cpu: bool = field(default=False, metadata={
        "help": "sd-scripts: run the text encoders on the CPU; here they run where the trainer puts them "
                "(a warning says so)"})
    vae_chunk_size: Optional[int] = field(default=None, metadata={
        "help": "sd-scripts: chunked VAE convolutions to save memory; diffusers' VAE here does not chunk "
                "(a warning says so)"})
    attn_mode: Optional[str] = field(default=None, metadata={
        "choices": ATTN_MODES,
        "help": "sd-scripts' attention backend of its own DiT; diffusers' model here uses PyTorch SDPA"})
    split_attn: bool = field(default=False, metadata={
        "help": "sd-scripts: attention one sample at a time; here the batch attends together with its mask"})
    flow: HunyuanImageFlowOptions = field(default_factory=HunyuanImageFlowOptions)

    def ignored_flags(self) -> list[str]:
        """The sd-scripts switches given that change nothing here."""
        names = [name for name in ("fp8_vl", "text_encoder_cpu", "split_attn") if getattr(self, name)]
        if self.vae_chunk_size is not None:
            names.append("vae_chunk_size")
        if self.attn_mode not in (None, "torch", "sdpa"):
            names.append("attn_mode")
        return [f"--{name}" for name in names]

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        if self.vae_chunk_size is not None and not (isinstance(self.vae_chunk_size, int) and self.vae_chunk_size >= 1):
            raise ConfigError(f"--vae_chunk_size: expected an integer >= 1, got {self.vae_chunk_size!r}")
        if self.attn_mode is not None and self.attn_mode not in ATTN_MODES:
            raise ConfigError(f"--attn_mode: expected one of {', '.join(ATTN_MODES)}, got {self.attn_mode!r}")
        self.flow.check()
