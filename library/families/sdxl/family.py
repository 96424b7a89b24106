"""The SDXL family: UNet with text_time conditioning, CLIP-L + OpenCLIP-bigG, SGM-named LoRA keys.

Text conditioning is sd-scripts': the penultimate hidden states of both
encoders (no final layer norm), concatenated along the channels for the UNet,
and the projected pooled output of encoder 2 (from the first 75-token chunk
when --max_token_length splits a caption). The size/crop ids come from the
batch: original size, the (flip-aware) crop top-left and the bucket size.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from library.core.errors import warn_once
from library.families.base import (
    Components,
    LoadOptions,
    ModelFamily,
    TextConditioning,
    check_single_file_name,
)
from library.families.common.clip_text import (
    TEXT_ENCODER_TARGETS,
    chunk_token_ids,
    join_token_chunks,
    penultimate_states,
    text_encoder_kohya_path,
)
from library.families.common.controlnet import save_controlnet_files
from library.families.sd.controlnet import create_unet_controlnet, unet_control_kwargs
from library.families.sd.family import UNET_CONV_TARGETS, UNET_TARGETS
from library.families.sdxl import saving as sdxl_saving
from library.families.sdxl.generate import encode_weighted_sdxl, generate_sdxl
from library.families.sdxl.loading import load_sdxl_components
from library.families.sdxl.lora_names import (
    convert_to_sgm_names,
    is_diffusers_named,
    sgm_lora_name,
    sgm_module_path,
)
from library.objectives.noise import DDPMScheme
from networks.lora_args import BlockLayout, sdxl_block_layout
from networks.lora_targets import LoraTarget, outside_block_targets

logger = logging.getLogger(__name__)

SGM_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"
TEXT_KEYS = ("hidden_state1", "hidden_state2", "pool2")  # also the keys of `*_te_outputs.npz`




def time_ids(batch: dict, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(B, 6) SDXL micro-conditioning: original (h, w), crop (top, left), target (h, w)."""
    parts = [batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"]]
    return torch.cat([p.reshape(-1, 2) for p in parts], dim=1).to(device=device, dtype=dtype)


class SDXLFamily(ModelFamily):
    """Stable Diffusion XL base (and fine-tunes of it), epsilon or v prediction."""

    name = "sdxl"
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 40
    single_file_markers = ("conditioner.embedders.",)
    contents = (("conditioner.embedders.", "an SDXL checkpoint"),)
    diffusers_class_markers = ("XL",)
    scripts = {"lora": "sdxl_train_network.py", "finetune": "sdxl_train.py",
               "textual_inversion": "sdxl_train_textual_inversion.py", "controlnet": "sdxl_train_control_net.py",
               "controlnet_lllite": "sdxl_train_control_net_lllite.py"}
    textual_inversion_keys = ("clip_l", "clip_g")
    selector_flag = "sdxl"
    text_encoder_labels = ("Text encoder 1 (CLIP-L)", "Text encoder 2 (OpenCLIP-G)")
    denoiser_label = "UNet"
    tiny_presets = ("tiny:sdxl",)
    latent_cache_arch = "_sdxl"
    block_classes = ("BasicTransformerBlock", "ResnetBlock2D")
    # gen_img's img2img / inpainting / regional prompts / highres fix (library/sampling/img2img.py)
    image_inputs = ("img2img", "inpaint", "regions", "highres", "highres_latents")
    default_image_size = 1024  # a request's size when neither prompt nor flag sets one
    latent_channels = 4
    vae_scale_factor = 8
    latents_scale = 0.13025
    latents_shift = 0.0
    bucket_reso_multiple = 32
    supports_text_cache = True
    text_cache_suffix = "_te_outputs.npz"

    # --- loading ----------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.sdxl.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.sdxl.saving import write_sdxl_preset

        check_single_file_name(out, single_file)
        write_sdxl_preset(preset, out, single_file=single_file)  # SDXL's own SGM layout
        return {preset: out}

    def load(self, opts: LoadOptions) -> Components:
        """A preset (tiny:sdxl, random:sdxl), an SDXL diffusers folder, or an SGM single-file checkpoint."""
        components = load_sdxl_components(opts)
        components.noise_schedule = opts.noise_schedule
        return components

    # --- text ---------------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        return [chunk_token_ids(tok, captions, max_token_length) for tok in components.tokenizers]

    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        self._warn_clip_skip(clip_skip)
        te1, te2 = components.text_encoders
        window = components.tokenizers[0].model_max_length
        batch = tokens[0].shape[0]
        h1, _ = penultimate_states(te1, tokens[0], window)
        h2, out2 = penultimate_states(te2, tokens[1], window)
        pooled = out2.text_embeds.reshape(batch, -1, out2.text_embeds.shape[-1])[:, 0]  # first chunk, as sd-scripts
        return TextConditioning(tensors={
            "hidden_state1": join_token_chunks(h1.reshape(batch, -1, h1.shape[-1]), window),
            "hidden_state2": join_token_chunks(h2.reshape(batch, -1, h2.shape[-1]), window),
            "pool2": pooled,
        })

    supports_weighted_captions = True

    def encode_weighted_captions(self, components: Components, captions: list[str], clip_skip: Optional[int],
                                 max_token_length: Optional[int], device: torch.device) -> TextConditioning:
        self._warn_clip_skip(clip_skip)
        n_chunks = (max_token_length or 75) // 75  # the windows encode_text uses: unweighted captions match it
        return TextConditioning(tensors=encode_weighted_sdxl(components, captions, n_chunks, device))

    def check_loaded(self, components: Components, text: Any) -> None:
        """--clip_skip is not used by SDXL (warned about at the first encode): nothing to check."""

    def _warn_clip_skip(self, clip_skip: Optional[int]) -> None:
        if clip_skip not in (None, 2):
            warn_once(logger, f"--clip_skip {clip_skip} is ignored: SDXL always uses the penultimate layer of both "
                              "encoders")

    # --- denoising ------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> DDPMScheme:
        return DDPMScheme.from_schedule(getattr(components, "noise_schedule", None),
                                        "v_prediction" if components.v_parameterization else "epsilon",
                                        zero_terminal_snr)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        t = text.tensors
        dtype, device = noisy_latents.dtype, noisy_latents.device
        hidden = torch.cat([t["hidden_state1"], t["hidden_state2"]], dim=2).to(device, dtype)
        added = {"text_embeds": t["pool2"].to(device, dtype), "time_ids": time_ids(batch, device, dtype)}
        control = unet_control_kwargs(components.controlnet, noisy_latents, timesteps, hidden, batch, added)
        return components.denoiser(noisy_latents, timesteps, hidden, added_cond_kwargs=added, **control).sample

    def create_controlnet(self, components: Components, path: Optional[str], num_double_blocks=None,
                          num_single_blocks=None):
        return create_unet_controlnet(components.denoiser, path)

    def save_controlnet(self, controlnet, path, fmt, dtype, metadata):
        return save_controlnet_files(controlnet, path, fmt, dtype, metadata)

    # --- generation -----------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:

        self._warn_clip_skip(clip_skip)
        return generate_sdxl(self, components, requests, device or components.denoiser.device)

    # --- LoRA -------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        te1, te2 = components.text_encoders
        return [
            LoraTarget("lora_unet", components.denoiser, UNET_TARGETS, UNET_CONV_TARGETS, rename=sgm_module_path),
            LoraTarget("lora_te1", te1, TEXT_ENCODER_TARGETS, is_text_encoder=True, rename=text_encoder_kohya_path),
            LoraTarget("lora_te2", te2, TEXT_ENCODER_TARGETS, is_text_encoder=True, rename=text_encoder_kohya_path),
            # input_blocks.0.0 (conv_in), out.2 (conv_out), time_embed, label_emb: only when a file has them
            # (LyCORIS preset=full)
            *outside_block_targets(components.denoiser, "lora_unet", rename=sgm_module_path),
        ]

    def lora_block_layout(self) -> BlockLayout:
        """The 23-block layout of block_dims / block lr weights for networks.lora (sd-scripts' SDXL layout)."""
        return sdxl_block_layout()

    def convert_lora_state_dict(self, state_dict: dict) -> dict:
        """A LoRA state dict in this family's kohya naming; diffusers-named SDXL files are renamed to SGM."""
        return convert_to_sgm_names(state_dict) if is_diffusers_named(state_dict) else state_dict

    def canonical_lora_name(self, name: str) -> str:
        return sgm_lora_name(name)

    # --- metadata -----------------------------------------------------------------------
    def _parts(self, components: Components) -> dict:
        te1, te2 = components.text_encoders
        return {"unet": components.denoiser, "vae": components.vae, "text_encoder": te1, "text_encoder_2": te2,
                "tokenizer": components.tokenizers[0], "tokenizer_2": components.tokenizers[1]}

    def single_file_state_dict(self, components: Components) -> dict[str, torch.Tensor]:
        """The SGM layout of sd_xl_base_1.0.safetensors (`model.diffusion_model.`, `first_stage_model.`,
        `conditioner.embedders.0.transformer.`, `conditioner.embedders.1.model.`)."""
        return sdxl_saving.sgm_tensors(self._parts(components))

    def pipeline_folder(self, components: Components) -> tuple[dict, dict]:
        return sdxl_saving.pipeline_folder(self._parts(components), components.v_parameterization)

    def base_model_version(self, components: Components) -> str:
        return "sdxl_base_v1-0"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "stable-diffusion-xl-v1-base"

    def modelspec_implementation(self) -> str:
        return SGM_IMPLEMENTATION
