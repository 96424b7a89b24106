"""The Stable Diffusion 1.x / 2.x family: one family, v2 read from the loaded model.

Text handling follows sd-scripts: prompts longer than 75 tokens (with
--max_token_length 150 / 225) are split into 75-token chunks, each wrapped in
BOS/EOS and encoded separately, and the chunk outputs are joined back into one
sequence of max_token_length + 2 states.
"""

from __future__ import annotations

from typing import Optional

import torch

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
    encode_token_chunks,
    text_encoder_kohya_path,
)
from library.families.common.controlnet import save_controlnet_files
from library.families.sd import saving as sd_saving
from library.families.sd.controlnet import create_unet_controlnet, unet_control_kwargs
from library.families.sd.generate import encode_weighted, generate_sd
from library.families.sd.loading import load_sd_components
from library.objectives.noise import DDPMScheme
from networks.lora_targets import LoraTarget, outside_block_targets

UNET_TARGETS = ("Transformer2DModel",)
UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
# transformers 5 has only CLIPAttention; older releases also have CLIPSdpaAttention.














class SDFamily(ModelFamily):
    """Stable Diffusion 1.x and 2.x (incl. v-prediction): UNet2DConditionModel + one CLIP text encoder."""

    name = "sd"
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 80
    single_file_markers = ("model.diffusion_model.",)
    contents = (("model.diffusion_model.input_blocks.", "an SD 1.x/2.x checkpoint"),)
    diffusers_class_markers = ("StableDiffusion",)
    scripts = {"lora": "train_network.py", "finetune": "fine_tune.py", "dreambooth": "train_db.py",
               "textual_inversion": "train_textual_inversion.py", "controlnet": "train_control_net.py"}
    textual_inversion_keys = ("emb_params",)
    text_encoder_labels = ("Text encoder (CLIP)",)
    denoiser_label = "UNet"
    tiny_presets = ("tiny:sd1", "tiny:sd2", "tiny:sd2-v")
    latent_cache_arch = "_sd"
    block_classes = ("BasicTransformerBlock", "ResnetBlock2D")
    # gen_img's img2img / inpainting / regional prompts / highres fix (library/sampling/img2img.py)
    image_inputs = ("img2img", "inpaint", "regions", "highres", "highres_latents")
    default_image_size = 512  # a request's size when neither prompt nor flag sets one
    latent_channels = 4
    vae_scale_factor = 8
    latents_scale = 0.18215
    latents_shift = 0.0
    bucket_reso_multiple = 64

    @classmethod
    def presets(cls) -> dict:
        from library.families.sd.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.sd.saving import write_preset

        check_single_file_name(out, single_file)
        write_preset(preset, out, single_file=single_file)
        return {preset: out}

    def load(self, opts: LoadOptions) -> Components:
        """Load a diffusers folder, a single-file checkpoint, a hub id from the local cache, or a preset."""
        components = load_sd_components(opts)
        components.noise_schedule = opts.noise_schedule
        return components

    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        return [chunk_token_ids(components.tokenizers[0], captions, max_token_length)]

    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        window = components.tokenizers[0].model_max_length
        states = encode_token_chunks(components.text_encoders[0], tokens[0], clip_skip, window)
        return TextConditioning(tensors={"encoder_hidden_states": states})

    supports_weighted_captions = True

    def encode_weighted_captions(self, components: Components, captions: list[str], clip_skip: Optional[int],
                                 max_token_length: Optional[int], device: torch.device) -> TextConditioning:
        n_chunks = (max_token_length or 75) // 75  # the windows encode_text uses: unweighted captions match it
        return TextConditioning(tensors={"encoder_hidden_states": encode_weighted(components, captions, clip_skip,
                                                                                  n_chunks, device)})

    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> DDPMScheme:
        return DDPMScheme.from_schedule(getattr(components, "noise_schedule", None),
                                        "v_prediction" if components.v_parameterization else "epsilon",
                                        zero_terminal_snr)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        hidden = text.tensors["encoder_hidden_states"]
        control = unet_control_kwargs(components.controlnet, noisy_latents, timesteps, hidden, batch)
        return components.denoiser(noisy_latents, timesteps, hidden, **control).sample

    def create_controlnet(self, components: Components, path: Optional[str], num_double_blocks=None,
                          num_single_blocks=None):
        return create_unet_controlnet(components.denoiser, path)

    def save_controlnet(self, controlnet, path, fmt, dtype, metadata):
        return save_controlnet_files(controlnet, path, fmt, dtype, metadata)

    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:

        return generate_sd(self, components, requests, clip_skip, device or components.denoiser.device)

    def lora_targets(self, components: Components) -> list[LoraTarget]:
        return [
            LoraTarget("lora_unet", components.denoiser, UNET_TARGETS, UNET_CONV_TARGETS),
            LoraTarget("lora_te", components.text_encoders[0], TEXT_ENCODER_TARGETS, is_text_encoder=True,
                       rename=text_encoder_kohya_path),
            # conv_in, conv_out, time_embedding: only when a file has them (LyCORIS preset=full)
            *outside_block_targets(components.denoiser, "lora_unet"),
        ]

    def single_file_state_dict(self, components: Components) -> dict[str, torch.Tensor]:
        """The original LDM layout (`model.diffusion_model.`, `first_stage_model.`, SD1 `cond_stage_model.transformer.`
        / SD2 OpenCLIP `cond_stage_model.model.`), as A1111 / Forge, ComfyUI and sd-scripts load it."""
        return sd_saving.ldm_tensors(components.denoiser, components.vae, components.text_encoders[0], components.v2)

    def pipeline_folder(self, components: Components) -> tuple[dict, dict]:
        return sd_saving.pipeline_folder(components.denoiser, components.vae, components.text_encoders[0],
                                         components.tokenizers[0], components.v_parameterization)

    def base_model_version(self, components: Components) -> str:
        if not components.v2:
            return "sd_v1"
        return "sd_v2_v" if components.v_parameterization else "sd_v2"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        if not components.v2:
            return "stable-diffusion-v1"
        return "stable-diffusion-v2-768-v" if components.v_parameterization else "stable-diffusion-v2-512"
