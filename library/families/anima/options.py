"""Anima's own options: component files, token lengths, the flow-matching scheme and its learning-rate groups.

Declared once here with their help text; library/cli turns them into sd-scripts' flags of the same names
(anima_train_utils.add_anima_training_arguments). --vae is the generic flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from library.core.errors import ConfigError
from library.objectives.flow import TIMESTEP_SAMPLINGS, FlowOptions

MAX_TOKENS = 512
# The flags naming Anima's parts beside the DiT file (the tools take them too; --vae is generic).
COMPONENT_FILE_FLAGS = ("qwen3", "llm_adapter_path", "t5_tokenizer_path")
# The denoiser parts anima_train.py gives their own learning rate, as sd-scripts names them.
LR_GROUPS = ("self_attn", "cross_attn", "mlp", "mod", "llm_adapter")


@dataclass
class AnimaFlowOptions(FlowOptions):
    """FLUX.1's flow-matching flags with sd-scripts' Anima defaults: sigmoid (logit-normal) sampling, shift 1."""
    timestep_sampling: str = field(default="sigmoid", metadata={
        "choices": TIMESTEP_SAMPLINGS,
        "help": "how σ is drawn: sigmoid (default, logit-normal), sigma (by --weighting_scheme, on the shifted "
                "schedule), uniform, shift (sigmoid then --discrete_flow_shift) or flux_shift (by image size)"})
    discrete_flow_shift: float = field(default=1.0, metadata={
        "help": "shift of the schedule for --timestep_sampling sigma and shift (default 1.0; > 1: noisier)"})


@dataclass
class AnimaOptions:
    """Where Anima's parts come from, how captions are tokenized, and how the model trains."""
    qwen3: Optional[str] = field(default=None, metadata={
        "help": "Anima: Qwen3-0.6B text encoder, a .safetensors file (qwen_3_06b_base.safetensors) or a folder"})
    llm_adapter_path: Optional[str] = field(default=None, metadata={
        "help": "Anima: LLM adapter weights in their own file (default: read from the DiT file, which holds "
                "llm_adapter.* when it has llm_adapter.out_proj.weight)"})
    t5_tokenizer_path: Optional[str] = field(default=None, metadata={
        "help": "Anima: T5 tokenizer folder for the LLM adapter's token ids (default: google/t5-v1_1-xxl from "
                "--tokenizer_cache_dir or the local cache)"})
    qwen3_max_token_length: int = field(default=512, metadata={
        "help": "Qwen3 tokens per caption (default 512)"})
    t5_max_token_length: int = field(default=512, metadata={
        "help": "T5 tokens per caption for the LLM adapter (default 512)"})
    llm_adapter_lr: Optional[float] = field(default=None, metadata={
        "help": "anima_train.py: learning rate of the LLM adapter (default: --learning_rate; 0 freezes it)"})
    self_attn_lr: Optional[float] = field(default=None, metadata={
        "help": "anima_train.py: learning rate of the DiT's self-attention layers (0 freezes them)"})
    cross_attn_lr: Optional[float] = field(default=None, metadata={
        "help": "anima_train.py: learning rate of the DiT's cross-attention layers (0 freezes them)"})
    mlp_lr: Optional[float] = field(default=None, metadata={
        "help": "anima_train.py: learning rate of the DiT's MLP layers (0 freezes them)"})
    mod_lr: Optional[float] = field(default=None, metadata={
        "help": "anima_train.py: learning rate of the DiT's AdaLN modulation layers (0 freezes them)"})
    # Memory switches of sd-scripts' own attention and VAE code: accepted so its command lines run; diffusers'
    # models here always use PyTorch SDPA and encode whole images (a warning says so when one is given).
    attn_mode: Optional[str] = field(default=None, metadata={
        "choices": ("torch", "sdpa", "xformers", "flash", "sageattn"),
        "help": "sd-scripts' attention backend; here PyTorch SDPA is used whatever is given (torch/sdpa)"})
    split_attn: bool = field(default=False, metadata={
        "help": "sd-scripts: split attention by batch to save memory; no effect here (a warning says so)"})
    vae_chunk_size: Optional[int] = field(default=None, metadata={
        "help": "sd-scripts: spatial chunk size of its VAE; no effect here (diffusers' VAE, whole images)"})
    vae_disable_cache: bool = field(default=False, metadata={
        "help": "sd-scripts: disable its VAE's internal cache; no effect here"})
    unsloth_offload_checkpointing: bool = field(default=False, metadata={
        "help": "sd-scripts: keep the checkpointed activations in CPU memory (non-blocking copies); here the same "
                "as --cpu_offload_checkpointing, which it turns on"})
    flow: AnimaFlowOptions = field(default_factory=AnimaFlowOptions)

    def ignored_flags(self) -> list[str]:
        """The sd-scripts memory flags given that change nothing here (for one warning)."""
        given = [("attn_mode", self.attn_mode not in (None, "torch", "sdpa")), ("split_attn", self.split_attn),
                 ("vae_chunk_size", self.vae_chunk_size is not None), ("vae_disable_cache", self.vae_disable_cache)]
        return [f"--{name}" for name, on in given if on]

    def check(self) -> None:
        """One-line ConfigError naming the flag of a value out of range."""
        for flag in ("qwen3_max_token_length", "t5_max_token_length"):
            value = getattr(self, flag)
            if not (isinstance(value, int) and 1 <= value <= MAX_TOKENS):
                raise ConfigError(f"--{flag}: expected an integer from 1 to {MAX_TOKENS}, got {value!r}")
        for group in LR_GROUPS:
            value = getattr(self, f"{group}_lr")
            if value is not None and not value >= 0:
                raise ConfigError(f"--{group}_lr: expected a learning rate >= 0 (0 freezes), got {value}")
        self.flow.check()
