"""The Chroma family: FLUX.1's rectified-flow DiT conditioned on T5-XXL alone (no CLIP-L), trained through
`flux_train_network.py --model_type chroma` as sd-scripts does.

What differs from FLUX.1 (everything else is inherited from FluxFamily): one text encoder (T5, whose
mask is required: sd-scripts asserts --apply_t5_attn_mask), no guidance input (diffusers' model feeds the
approximator a guidance of 0, so --guidance_scale must be 0 as sd-scripts' docs ask), the attention mask
keeps one padding token after each caption (Chroma's own rule, also diffusers' ChromaPipeline's), LoRA
only on the blocks' attention and MLP layers (the blocks have no modulation layers), and the names
written into metadata.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch

from library.core.errors import ConfigError, UserError, warn_once
from library.families.base import Components, LoadOptions, ModelFamily, TextConditioning
from library.families.chroma.generate import generate_chroma
from library.families.chroma.model import (
    CHROMA_IMPLEMENTATION,
    chroma_block_counts,
    chroma_source_kind,
    chroma_to_single_file,
    load_chroma_components,
)
from library.families.common.t5 import T5_TARGETS
from library.families.flux.family import (
    FluxFamily,
    image_ids,
    pack_latents,
    swap_split,
    unpack_latents,
)
from library.families.flux.lora_names import bfl_module_path, fused_slot
from library.families.flux.network_args import FluxNetworkArgs
from library.families.flux.options import FluxOptions
from library.objectives.flow import check_flow_compatible, check_no_ddpm_schedule
from networks.lora_targets import LoraTarget

# diffusers' Chroma block classes: the same layers as FLUX.1's blocks minus the modulation Linears.
CHROMA_TARGETS = ("ChromaTransformerBlock", "ChromaSingleTransformerBlock")
logger = logging.getLogger(__name__)
CHROMA_T5_DEFAULT_TOKENS = 512  # sd-scripts: 512 unless schnell, and Chroma is not schnell


class ChromaFamily(FluxFamily):
    """Chroma (diffusers ChromaTransformer2DModel + T5-XXL + the FLUX.1 AE), trained with rectified flow."""

    image_inputs = ()  # its own sampling loop: no img2img / inpainting / highres fix yet

    name = "chroma"
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 50
    single_file_markers = ("distilled_guidance_layer.",
                           "model.diffusion_model.distilled_guidance_layer.")
    contents = (("distilled_guidance_layer.", "a Chroma transformer"),)
    diffusers_class_markers = ()
    model_types = ("chroma",)  # the --model_type values of its scripts that select it
    selector_flag = None
    variant_of = "flux"  # FLUX.1's scripts with --model_type chroma
    # FLUX.1's scripts less flux_train_control_net.py: its ControlNet is FLUX.1's (FluxControlNetModel)
    scripts = {mode: script for mode, script in FluxFamily.scripts.items() if mode != "controlnet"}
    text_encoder_labels = ("Text encoder (T5-XXL)",)
    tiny_presets = ("tiny:chroma",)
    component_file_flags = ("t5xxl", "ae")  # FLUX.1's, less CLIP-L (Chroma has no CLIP)
    options_type = FluxOptions  # the flags of flux_train_network.py, with --model_type chroma
    text_encoder_outputs = (("t5_out", "txt_ids", "t5_attn_mask"),)
    text_cache_suffix = "_chroma_te.npz"
    context_parallel_token_pixels = None  # diffusers' ChromaTransformer2DModel has no context-parallel plan
    tensor_parallel = False  # nor a tensor-parallel one
    block_classes = CHROMA_TARGETS  # the repeated blocks FSDP wraps and --torch_compile compiles one by one
    lycoris_module_aliases = (("DoubleStreamBlock", "ChromaTransformerBlock"),
                              ("SingleStreamBlock", "ChromaSingleTransformerBlock"))
    save_formats = ("safetensors",)  # the single file sd-scripts reads; no diffusers folder

    @classmethod
    def presets(cls) -> dict:
        from library.families.chroma.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.chroma.model import write_chroma_preset

        if not single_file:
            raise UserError("--family chroma: add --single_file (Chroma is published as a single file; sd-scripts "
                            "loads no diffusers folder of it)")
        return write_chroma_preset(preset, out)

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        return ("flux_train_network.py --model_type chroma --apply_t5_attn_mask --guidance_scale 0 "
                f"--pretrained_model_name_or_path {written['transformer']} --t5xxl {written['t5xxl']} "
                f"--ae {written['ae']}")

    def variant(self, options: FluxOptions) -> ModelFamily:
        if options.model_type != "chroma":
            raise ConfigError(f"--model_type {options.model_type}: this is the Chroma family; give --model_type "
                              "chroma or use FLUX.1")
        return self

    # --- options ---------------------------------------------------------------------
    def check_options(self, options: FluxOptions, model: LoadOptions, *, blocks_to_swap: Optional[int] = None,
                      min_timestep: Optional[int] = None, max_timestep: Optional[int] = None,
                      zero_terminal_snr: bool = False) -> None:
        """FLUX.1's checks, and Chroma's own: T5 masking on, guidance 0, no CLIP-L, a single file or preset."""
        check_flow_compatible(min_timestep, max_timestep, zero_terminal_snr)
        check_no_ddpm_schedule(model.v_parameterization, model.noise_schedule, "Chroma", "--timestep_sampling and --discrete_flow_shift")
        if not options.apply_t5_attn_mask:
            raise ConfigError("--model_type chroma: needs --apply_t5_attn_mask (Chroma masks T5 padding; "
                              "sd-scripts requires it too)")
        if options.guidance_scale != 0:
            raise ConfigError(f"--guidance_scale {options.guidance_scale:g}: Chroma is not guidance-distilled; "
                              "give --guidance_scale 0 (as sd-scripts' docs ask)")
        if options.clip_l:
            raise ConfigError("--clip_l: Chroma has no CLIP-L text encoder; drop the flag")
        path = model.pretrained_model_name_or_path
        if path:
            chroma_source_kind(path)
            counts = chroma_block_counts(path) if blocks_to_swap else None
            if counts:
                swap_split(blocks_to_swap, *counts)

    def text_cache_values(self, options: FluxOptions) -> dict[str, Any]:
        return {"t5xxl": options.t5xxl, "t5xxl_max_token_length": options.t5xxl_max_token_length,
                "apply_t5_attn_mask": options.apply_t5_attn_mask}

    # --- loading ---------------------------------------------------------------------
    def load(self, opts: LoadOptions) -> Components:
        """A preset (tiny:chroma, random:chroma) or a Chroma single file with --t5xxl and --ae."""
        # What Chroma requires (training refuses anything else in check_options; tools/generate.py passes only the
        # component files, so the rest is set here).
        options = replace(opts.family_options or FluxOptions(), apply_t5_attn_mask=True, guidance_scale=0.0,
                          model_type="chroma")
        components = load_chroma_components(opts, options.t5xxl, options.ae)
        components.options = options
        return components

    # --- text --------------------------------------------------------------------------
    def t5_token_length(self, components: Components) -> int:
        return self.options(components).t5xxl_max_token_length or CHROMA_T5_DEFAULT_TOKENS

    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[T5 ids (B, L), T5 attention mask (B, L)]."""
        if max_token_length not in (None, 75):
            warn_once(logger, "--max_token_length is ignored for Chroma; use --t5xxl_max_token_length")
        t5 = components.tokenizers[0](captions, padding="max_length", truncation=True,
                                      max_length=self.t5_token_length(components), return_tensors="pt")
        return [t5.input_ids, t5.attention_mask]

    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        return self.encode_text_with(components, tokens, clip_skip, frozenset((0,)))

    def encode_text_with(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int],
                         encoders: frozenset[int]) -> TextConditioning:
        """T5's last hidden states (masked), zero text position ids and the mask."""
        t5 = components.text_encoders[0]
        ids, mask = tokens
        mask = mask.to(t5.device)
        out = t5(ids.to(t5.device), attention_mask=mask, return_dict=True).last_hidden_state
        zeros = torch.zeros(out.shape[0], out.shape[1], 3, device=out.device, dtype=out.dtype)
        return TextConditioning(tensors={"t5_out": out, "txt_ids": zeros, "t5_attn_mask": mask})

    # --- denoising -------------------------------------------------------------------------
    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        model = components.denoiser
        t = text.tensors
        dtype, device = noisy_latents.dtype, noisy_latents.device
        h, w = noisy_latents.shape[-2:]
        out = model(hidden_states=pack_latents(noisy_latents), encoder_hidden_states=t["t5_out"].to(device, dtype),
                    timestep=(timesteps.float() / 1000).to(device, dtype), img_ids=image_ids(h, w, device, dtype),
                    txt_ids=t["txt_ids"][0].to(device, dtype),
                    attention_mask=joint_attention_mask(t["t5_attn_mask"].to(device), (h // 2) * (w // 2)),
                    return_dict=False)[0]
        return unpack_latents(out, h, w)

    # --- generation -------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        """T5-only, masked, true-CFG flow-match Euler generation (library/families/chroma/generate.py)."""
        return generate_chroma(self, components, requests, device or components.denoiser.device)

    # --- LoRA ---------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet on the blocks' attention and MLP layers (BFL names, fused qkv / linear1), as sd-scripts'
        lora_flux.py finds them in Chroma's DoubleStreamBlock / SingleStreamBlock; T5 (`lora_te3`) with
        `train_t5xxl=True`. Chroma has no CLIP-L, so no lora_te1."""
        transformer = components.denoiser
        args = FluxNetworkArgs.for_transformer(transformer)
        targets = [LoraTarget("lora_unet", transformer, CHROMA_TARGETS, rename=bfl_module_path, fused_slot=fused_slot,
                              network_args=args, external_prefix="lycoris")]
        if components.text_encoders:
            targets.append(replace(self.t5_lora_target(components), enabled_by="train_t5xxl", network_args=args))
        return targets

    def t5_lora_target(self, components: Components) -> LoraTarget:
        return LoraTarget("lora_te3", components.text_encoders[0], T5_TARGETS, is_text_encoder=True)

    # --- saving -------------------------------------------------------------------------------------
    def single_file_state_dict(self, components: Components) -> dict:
        """The transformer alone in Chroma's single-file layout (the T5 and AE files are FLUX.1's)."""
        return chroma_to_single_file(components.denoiser.state_dict(), lazy=True)

    # --- metadata -------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        return "chroma"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "chroma"

    def modelspec_implementation(self) -> str:
        return CHROMA_IMPLEMENTATION


def joint_attention_mask(t5_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """(B, text + image) boolean mask over the joint sequence: each caption's tokens and one padding token after
    them (Chroma's rule), then every image token."""
    lengths = t5_mask.sum(dim=1, keepdim=True)
    positions = torch.arange(t5_mask.shape[1], device=t5_mask.device)[None, :]
    text = positions <= lengths
    return torch.cat([text, torch.ones(t5_mask.shape[0], image_tokens, dtype=torch.bool, device=t5_mask.device)], 1)

