"""The Z-Image family (Tongyi-MAI Z-Image Turbo and Base): the S3-DiT (diffusers ZImageTransformer2DModel), Qwen3-4B
text, the FLUX.1 AE, rectified flow, trained as musubi-tuner's zimage_train_network.py trains it.

Text as diffusers' ZImagePipeline: each caption in Qwen3's chat template (one user turn, the assistant turn opened),
tokens padded right to --qwen3_max_token_length (default 512), Qwen3's second-to-last hidden states and the mask
(`hidden_state`, `input_ids`, `attention_mask`); the DiT takes each caption's unpadded tokens. Latents are the
FLUX.1 AE's (x - 0.1159) · 0.3611. The model is called with t = 1 - σ on a list of (C, 1, H, W) latents and predicts
x0 - ε (the pipeline negates it); predict returns its negation, the velocity ε - x0 of the project's flow scheme.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from library.core.errors import ConfigError
from library.families.base import Components, LoadOptions, TextConditioning, check_folder_name
from library.families.common.autoencoder import AE_SCALING_FACTOR, AE_SHIFT_FACTOR
from library.families.common.flow_dit import FlowDiTFamily, FluxAELatents
from library.families.common.llm_text import TEXT_KEYS as LLM_TEXT_KEYS
from library.families.common.llm_text import second_to_last_states
from library.families.common.swap_rules import check_last_blocks_swap, last_blocks
from library.families.zimage import layout
from library.families.zimage.configs import CHAT_TEMPLATE, LATENT_CHANNELS
from library.families.zimage.generate import generate_zimage
from library.families.zimage.loading import block_count, check_model_source, load_zimage_components
from library.families.zimage.network_args import ZImageNetworkArgs
from library.families.zimage.options import COMPONENT_FILE_FLAGS, ZImageOptions
from library.objectives.flow import FlowMatchScheme
from networks.lora_targets import LoraTarget

logger = logging.getLogger(__name__)

ZIMAGE_IMPLEMENTATION = "https://github.com/Tongyi-MAI/Z-Image"
# musubi-tuner's networks/lora_zimage.py: ZImageTransformerBlock (main layers and both refiners; the refiners and the
# AdaLN projections are then left out by default, zimage/network_args.py); Qwen3's attention and MLP.
TRANSFORMER_TARGETS = ("ZImageTransformerBlock",)
QWEN3_TARGETS = ("Qwen3Attention", "Qwen3MLP")


class ZImageFamily(FluxAELatents, FlowDiTFamily):
    """Z-Image (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image)."""

    name = "zimage"
    display_name = "Z-Image"
    metadata_flow_keys = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling",
                          "sigmoid_scale", "model_prediction_type", "discrete_flow_shift")
    # Before Lumina (both have `layers.0.attention.qkv`): only Z-Image's blocks have `adaLN_modulation.0` (one Linear,
    # no SiLU in front) and `cap_pad_token`.
    detect_rank = 19
    single_file_markers = ("layers.0.adaLN_modulation.0.", "model.diffusion_model.layers.0.adaLN_modulation.0.",
                           "cap_pad_token", "model.diffusion_model.cap_pad_token")
    contents = (("cap_pad_token", "a Z-Image DiT"), ("model.diffusion_model.cap_pad_token", "a Z-Image DiT"),
                ("model.layers.0.self_attn.q_norm.", "a Qwen3 text encoder"))
    diffusers_class_markers = ("ZImage",)
    scripts = {"lora": "zimage_train_network.py", "finetune": "zimage_train.py"}
    text_encoder_labels = ("Text encoder (Qwen3)",)
    denoiser_label = "DiT"
    component_file_flags = COMPONENT_FILE_FLAGS
    tiny_presets = ("tiny:zimage",)
    options_type = ZImageOptions
    lora_network_module = "networks.lora_zimage"  # musubi-tuner's name
    latent_cache_arch = "_zimage"
    block_classes = ("ZImageTransformerBlock",)  # the repeated blocks FSDP wraps and --torch_compile compiles
    latent_cache_key_stride = 8
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = 8
    latents_scale = 1.0  # encode_images already applies the AE's shift and scale
    latents_shift = 0.0
    ae_scale = AE_SCALING_FACTOR
    ae_shift = AE_SHIFT_FACTOR
    bucket_reso_multiple = 16  # 8x AE, 2x2 patches
    supports_text_cache = True
    text_cache_suffix = "_zimage_te.npz"
    TEXT_KEYS = LLM_TEXT_KEYS

    # --- options -------------------------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.zimage.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.zimage.loading import write_zimage_preset

        check_folder_name(out, "Z-Image is written as a diffusers folder and ComfyUI's three files")
        return write_zimage_preset(preset, out)

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        return (f"--pretrained_model_name_or_path {written['diffusers']}  (or {written['dit']} --qwen3 "
                f"{written['qwen3']} --ae {written['ae']})")

    def check_model_files(self, path: str, options: ZImageOptions, vae: Optional[str],
                          blocks_to_swap: Optional[int]) -> None:
        check_model_source(path, options, vae)
        blocks = block_count(path) if blocks_to_swap else None
        if blocks:
            check_last_blocks_swap(blocks_to_swap, blocks)

    def text_cache_values(self, options: ZImageOptions) -> dict[str, Any]:
        return {"qwen3": options.qwen3, "qwen3_max_token_length": options.max_tokens}

    # --- loading -------------------------------------------------------------------------------------
    def load_components(self, opts: LoadOptions, options: ZImageOptions) -> Components:
        """The preset tiny:zimage / random:zimage, a diffusers folder, or an original DiT file with --qwen3 and --ae."""
        return load_zimage_components(opts, options)

    # --- text ----------------------------------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str],
                 max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[Qwen ids, mask] (B, --qwen3_max_token_length) of each caption in the chat template."""
        tokenizer = components.tokenizers[0]
        out = tokenizer([CHAT_TEMPLATE.format(c) for c in captions], padding="max_length", truncation=True,
                        max_length=self.options(components).max_tokens, return_tensors="pt")
        return [out.input_ids, out.attention_mask]

    def encode_text(self, components: Components, tokens: list[torch.Tensor],
                    clip_skip: Optional[int]) -> TextConditioning:
        """Qwen3's second-to-last hidden states, the ids and the mask (as diffusers' ZImagePipeline)."""
        return second_to_last_states(components.text_encoders[0], tokens)

    def check_loaded(self, components: Components, text: Any) -> None:
        if getattr(text, "clip_skip", None) is not None:
            raise ConfigError("--clip_skip: Z-Image uses Qwen3's second-to-last hidden states; drop --clip_skip")

    # --- denoising -----------------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> FlowMatchScheme:
        return FlowMatchScheme(self.options(components).flow)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        """The velocity ε - x0: the DiT at t = 1 - σ on each latent and its caption's unpadded tokens, negated."""
        model = components.denoiser
        device, dtype = noisy_latents.device, noisy_latents.dtype
        t = text.tensors
        states = t["hidden_state"].to(device, dtype)
        mask = t["attention_mask"].to(device).bool()
        captions = [states[i][mask[i]] for i in range(states.shape[0])]
        x = list(noisy_latents.unsqueeze(2).unbind(0))
        out = model(x, (1 - timesteps.float() / 1000).to(device, dtype), captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # --- generation ----------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        if components.vae is None:
            raise ConfigError("--ae: required to decode Z-Image images (the FLUX.1 ae.safetensors)")
        return generate_zimage(self, components, requests, device or components.denoiser.device)

    # --- LoRA ----------------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet: the main blocks under their original (ComfyUI) names, q, k, v as one fused `attention_qkv`
        (refiners and AdaLN with train_refiners / train_modulation); lora_te: Qwen3's attention and MLP."""
        args = ZImageNetworkArgs()
        targets = [LoraTarget("lora_unet", components.denoiser, TRANSFORMER_TARGETS, rename=layout.original_path,
                              fused_slot=layout.fused_slot, external_prefix="lycoris", network_args=args)]
        if components.text_encoders and components.text_encoders[0] is not None:
            targets.append(LoraTarget("lora_te", components.text_encoders[0], QWEN3_TARGETS, is_text_encoder=True,
                                      network_args=args))
        return targets

    # --- saving --------------------------------------------------------------------------------------
    # One .safetensors DiT file in the original (ComfyUI) names; Qwen3 and the AE unchanged.
    save_formats = ("safetensors",)

    def single_file_state_dict(self, components: Components) -> dict:
        return layout.to_original(components.denoiser.state_dict())

    # --- memory --------------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        """The last N main blocks (`layers`); at most blocks - 2 (musubi-tuner: 28 of 30)."""
        return last_blocks(list(components.denoiser.layers), num_swap)

    # --- metadata ------------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        return "zimage"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "z-image"

    def modelspec_implementation(self) -> str:
        return ZIMAGE_IMPLEMENTATION

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return None  # a flow model: sd-scripts writes no prediction type (as FLUX.1)
