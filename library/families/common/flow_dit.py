"""What the rectified-flow DiT families (Anima, Lumina, HunyuanImage, Z-Image) share: the option checks before
loading, the flow settings recorded in the metadata, loading with the family's options, and the FLUX.1 AE's
latent normalisation for those that use it.

A family subclasses FlowDiTFamily, names itself for messages (`display_name`), lists the FlowOptions fields its
reference trainer records (`metadata_flow_keys`, in that trainer's order) and implements `load_components` and
`check_model_files` (its files and its --blocks_to_swap rule).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Optional

import torch

from library.families.base import Components, LoadOptions, ModelFamily
from library.families.common.autoencoder import denormalize_ae_latents, normalize_ae_latents
from library.objectives.flow import check_flow_compatible, check_no_ddpm_schedule

logger = logging.getLogger(__name__)


class FlowDiTFamily(ModelFamily):
    """A rectified-flow DiT family whose options (`options_type`) carry `flow`, `check()` and `ignored_flags()`."""

    display_name: ClassVar[str] = ""  # "Lumina", in messages
    metadata_flow_keys: ClassVar[tuple[str, ...]] = ()
    # Said after the names of the given flags that change nothing here (options.ignored_flags()).
    ignored_flags_note: ClassVar[str] = "they change nothing with diffusers' models here"

    def check_options(self, options: Any, model: LoadOptions, *, blocks_to_swap: Optional[int] = None,
                      min_timestep: Optional[int] = None, max_timestep: Optional[int] = None,
                      zero_terminal_snr: bool = False) -> None:
        check_flow_compatible(min_timestep, max_timestep, zero_terminal_snr)
        check_no_ddpm_schedule(model.v_parameterization, model.noise_schedule, self.display_name,
                               "--timestep_sampling and --discrete_flow_shift")
        options.check()
        if model.pretrained_model_name_or_path:
            self.check_model_files(model.pretrained_model_name_or_path, options, model.vae, blocks_to_swap)
        ignored = options.ignored_flags() if hasattr(options, "ignored_flags") else []
        if ignored:
            logger.warning("%s: %s", ", ".join(ignored), self.ignored_flags_note)

    def check_model_files(self, path: str, options: Any, vae: Optional[str], blocks_to_swap: Optional[int]) -> None:
        """The model files exist and suit the family, and --blocks_to_swap suits the model (one-line errors)."""
        raise NotImplementedError

    def metadata_values(self, options: Any) -> dict[str, Any]:
        flow = options.flow
        return {key: getattr(flow, key) for key in self.metadata_flow_keys}

    def load(self, opts: LoadOptions) -> Components:
        options = opts.family_options if opts.family_options is not None else self.options_type()
        components = self.load_components(opts, options)
        components.options = options
        return components

    def load_components(self, opts: LoadOptions, options: Any) -> Components:
        raise NotImplementedError


class FluxAELatents:
    """Latents of the FLUX.1 AE, (x - shift) · scale (a mixin before the family's ModelFamily base)."""

    @torch.no_grad()
    def encode_images(self, vae, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Images in [-1, 1] -> FLUX.1 AE latents (x - shift) · scale, float32 (B, 16, H/8, W/8)."""
        return normalize_ae_latents(vae, super().encode_images(vae, images, generator))

    def denormalize_latents(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return denormalize_ae_latents(vae, latents)
