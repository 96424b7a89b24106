"""The interface every model family implements; the training loop knows only this.

A family module (sd.py, later sdxl.py, flux.py) owns everything model-specific:
loading, tokenising, text encoding, the noise scheme, the model call, the LoRA
targets and their kohya names, and the strings written into metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from library.errors import UserError


class ModelLoadError(UserError):
    """A model path/preset could not be loaded; the message is one line for the user."""


@dataclass
class LoadOptions:
    """What a family needs to load a model (translated from flags in library/args/model.py)."""

    pretrained_model_name_or_path: str
    vae: Optional[str] = None
    v2: bool = False
    v_parameterization: bool = False
    dtype: torch.dtype = torch.float32
    vae_dtype: torch.dtype = torch.float32
    tokenizer_cache_dir: Optional[str] = None


@dataclass
class Components:
    """The loaded parts of one model. `denoiser` is the UNet (or DiT transformer)."""

    denoiser: nn.Module
    vae: nn.Module
    text_encoders: list[nn.Module]
    tokenizers: list[Any]
    v_parameterization: bool = False
    v2: bool = False
    model_path: str = ""  # what the user passed (for ss_sd_model_name and hashes)
    vae_path: Optional[str] = None


@dataclass
class LoraTarget:
    """One model part that receives LoRA modules.

    Every nn.Linear / nn.Conv2d inside a submodule whose class name is in
    `target_classes` gets a LoRA; `conv_target_classes` are added when conv_dim is
    set. The kohya module name is `prefix + "_" + rename(path).replace(".", "_")`
    where `path` is the dotted module path inside `root`.
    """

    prefix: str  # "lora_unet", "lora_te", "lora_te1", ...
    root: nn.Module
    target_classes: tuple[str, ...]
    conv_target_classes: tuple[str, ...] = ()
    is_text_encoder: bool = False
    rename: Optional[Callable[[str], str]] = None  # diffusers path -> kohya path (SDXL: SGM names)
    # Fused kohya modules (Flux `img_attn_qkv`, `linear1`): diffusers path -> the position of its
    # output slice in the fused module named by `rename`, or None for an ordinary module. Modules
    # that share a kohya name become one LoRA with a shared lora_down and one lora_up slice each.
    fused_slot: Optional[Callable[[str], Optional[int]]] = None
    # The prefix that modules of an external network (lycoris.kohya), which keep raw module paths under a
    # fused target, get in saved files instead of `prefix` (Flux: "lycoris", which ComfyUI maps from
    # diffusers paths onto its fused BFL weights). None: `prefix`.
    external_prefix: Optional[str] = None
    # An optional target: the --network_args key that turns it on (Flux: T5 by train_t5xxl, the layers outside
    # the blocks by in_dims). A network built from a file (--dim_from_weights, generation, merging) takes every
    # module the file has, whatever this says. None: always on.
    enabled_by: Optional[str] = None
    # The family's own networks.lora --network_args (networks/lora_rules.py NetworkArgRules: the keys it reads and
    # the per-module dims / learning rates they give); the same object on each of the family's targets.
    network_args: Optional[Any] = None


@dataclass
class TextConditioning:
    """Output of `encode_text`: tensors the denoiser needs, batch-first."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelFamily:
    """Base class; subclasses fill in the class attributes and methods."""

    name: str = ""  # "sd1", "sd2", "sdxl", "flux"
    latent_cache_arch: str = ""  # suffix of disk latent caches: "_sd", "_sdxl", "_flux"
    # Disk latent keys carry the latent size, `latents_<h>x<w>` (h, w = bucket size / this stride), as
    # sd-scripts' Flux caches do; None: plain `latents` keys (SD, SDXL).
    latent_cache_key_stride: Optional[int] = None
    latent_channels: int = 4
    vae_scale_factor: int = 8
    latents_scale: float = 0.18215  # applied at train time; caches hold unscaled latents
    latents_shift: float = 0.0
    bucket_reso_multiple: int = 64  # bucket_reso_steps must be a multiple of this
    # This family's own flags that change what the text encoders output (part of the text-cache validity key).
    text_cache_flags: tuple[str, ...] = ()
    # This family's own flags that name or change the VAE (part of the latent-cache validity key).
    latent_cache_flags: tuple[str, ...] = ()
    # The TextConditioning keys each text encoder produces, in encoder order. Given, the outputs of frozen
    # encoders can be cached while another one trains (Flux: T5 cached, CLIP-L trained, as sd-scripts
    # allows); empty: the outputs are cached all together or not at all.
    text_encoder_outputs: tuple[tuple[str, ...], ...] = ()
    # This family's own flags that saved LoRAs mirror as ss_<flag> metadata.
    metadata_flags: tuple[str, ...] = ()
    # Why a --network_module other than networks.lora (e.g. lycoris.kohya) cannot train this family; None: it can.
    external_networks_unsupported: Optional[str] = None
    # (class a LyCORIS preset names, this family's class that plays its role): a preset listing the
    # first also wraps modules of the second (Flux: BFL block classes -> diffusers block classes).
    lycoris_module_aliases: tuple[tuple[str, str], ...] = ()

    # --- flags ---------------------------------------------------------------
    def configure_from_args(self, flags: dict) -> None:
        """Read and check this family's own flags (those its add_arguments adds) before anything loads."""

    # --- loading -----------------------------------------------------------
    def load(self, opts: LoadOptions) -> Components:
        raise NotImplementedError

    # --- text --------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        """One LongTensor per tokenizer, shape (B, n_chunks * 77) for CLIP families."""
        raise NotImplementedError

    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        raise NotImplementedError

    def encode_text_with(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int],
                         encoders: frozenset[int]) -> TextConditioning:
        """The outputs of only the text encoders numbered in `encoders` (see text_encoder_outputs).

        This default encodes with all of them and keeps those keys; a family overrides it to run
        only the encoders asked for.
        """
        text = self.encode_text(components, tokens, clip_skip)
        keep = {key for i in encoders for key in self.text_encoder_outputs[i]}
        return TextConditioning({k: v for k, v in text.tensors.items() if k in keep})

    # --- images ------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae: nn.Module, images: torch.Tensor,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Images in [-1, 1] (B,3,H,W) -> unscaled latents (B,C,H/8,W/8), float32.

        The posterior sample draws from `generator` when given (validation needs fixed draws).
        """
        dist = vae.encode(images.to(vae.device, vae.dtype)).latent_dist
        return dist.sample(generator=generator).float()

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.latents_shift) * self.latents_scale

    # --- denoising -----------------------------------------------------------
    def noise_scheme(self, components: Components, **options: Any):
        """The noise/timestep scheme (library/train/noise.py) this family trains with."""
        raise NotImplementedError

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    # --- generation ------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        """Denoise one batch of library.sampling.generate.GenerationRequests (same size, steps, scale,
        sampler) into GeneratedImages, filling in this family's defaults."""
        raise NotImplementedError(f"{self.name}: image generation is not implemented for this family yet")

    # --- LoRA ----------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        raise NotImplementedError

    # --- memory ----------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list[nn.Module]:
        """The denoiser blocks --blocks_to_swap N keeps in CPU memory, in forward order.

        A family that streams blocks overrides this (its rule turns N into blocks and checks
        the bound); the default refuses the flag.
        """
        raise UserError(f"--blocks_to_swap is not supported for {self.name}")

    # --- saving ----------------------------------------------------------------
    def save_checkpoint(self, components: Components, path: str, dtype: Optional[torch.dtype] = None) -> None:
        """Write the whole model: one file (.safetensors/.ckpt, original layout) or a diffusers folder."""
        raise NotImplementedError(f"model family {self.name!r} cannot save checkpoints yet")

    # --- metadata --------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        """ss_base_model_version: sd_v1, sd_v2, sd_v2_v, sdxl_base_v1-0, flux1."""
        raise NotImplementedError

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        """modelspec.architecture without the '/lora' suffix."""
        raise NotImplementedError

    def modelspec_implementation(self) -> str:
        return "diffusers"
