"""The Qwen-Image family: Qwen's 20B MMDiT (diffusers QwenImageTransformer2DModel), Qwen2.5-VL-7B text, its Wan-style
16-channel VAE, rectified flow; LoRA files in the kohya / musubi-tuner names ComfyUI loads.

Text as diffusers' QwenImagePipeline (text.py): Qwen2.5-VL's last hidden states of the caption in its chat template,
the template's first 34 tokens dropped. Latents are the VAE's, normalised per channel by its latents_mean /
latents_std, packed in 2x2 patches (64 features a token). The DiT is called with t = σ and predicts the velocity
ε - x0 (musubi-tuner's target, noise - latents).

Qwen-Image-Edit / -2509 / -2511 (--model_version edit*): the same DiT with the control images' latents packed after
the target's; Qwen2.5-VL with its vision tower reads the control images with the caption (text.py tokenize_edit /
encode_edit, as QwenImageEditPipeline / QwenImageEditPlusPipeline), so a sample's text key holds its control images.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from library.core.errors import ConfigError
from library.families.base import Components, LoadOptions, TextConditioning, check_folder_name
from library.families.common.flow_dit import FlowDiTFamily
from library.families.qwen_image import lora_names
from library.families.qwen_image import text as text_rules
from library.families.qwen_image.configs import LATENT_CHANNELS, LATENTS_MEAN, LATENTS_STD, PATCH, VAE_SCALE_FACTOR
from library.families.qwen_image.loading import block_count, check_model_source, load_components
from library.families.qwen_image.network_args import QwenImageNetworkArgs
from library.families.qwen_image.options import COMPONENT_FILE_FLAGS, QwenImageOptions
from library.objectives.flow import FlowMatchScheme
from networks.lora_targets import LoraTarget

logger = logging.getLogger(__name__)

QWEN_IMAGE_IMPLEMENTATION = "https://github.com/QwenLM/Qwen-Image"
TRANSFORMER_TARGETS = ("QwenImageTransformerBlock",)  # musubi-tuner's QWEN_IMAGE_TARGET_REPLACE_MODULES


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2·W/2, 4C), the pipeline's _pack_latents."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, H/2·W/2, 4C) -> (B, C, H, W), the pipeline's _unpack_latents."""
    b, _, features = tokens.shape
    c = features // 4
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


class QwenImageFamily(FlowDiTFamily):
    """Qwen-Image (Qwen/Qwen-Image)."""

    name = "qwen_image"
    display_name = "Qwen-Image"
    metadata_flow_keys = ("timestep_sampling", "sigmoid_scale", "model_prediction_type", "discrete_flow_shift",
                          "weighting_scheme")
    ignored_flags_note = "switches of musubi-tuner's own Qwen-Image code that change nothing here"
    detect_rank = 12
    single_file_markers = ("transformer_blocks.0.img_mod.1.weight",
                           "model.diffusion_model.transformer_blocks.0.img_mod.1.weight")
    contents = (("transformer_blocks.0.img_mod.1.weight", "a Qwen-Image DiT"),
                ("model.diffusion_model.transformer_blocks.0.img_mod.1.weight", "a Qwen-Image DiT"))
    diffusers_class_markers = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    scripts = {"lora": "qwen_image_train_network.py", "finetune": "qwen_image_train.py"}
    text_encoder_labels = ("Text encoder (Qwen2.5-VL)",)
    denoiser_label = "DiT"
    component_file_flags = COMPONENT_FILE_FLAGS
    flag_aliases = (("fp8_scaled", "fp8_base_unet"),)
    tiny_presets = ("tiny:qwen_image", "tiny:qwen_image_edit")
    options_type = QwenImageOptions
    lora_network_module = "networks.lora_qwen_image"  # musubi-tuner's module name, recorded in saved files
    latent_cache_arch = "_qi"  # musubi-tuner's architecture short name
    latent_cache_key_stride = VAE_SCALE_FACTOR
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = VAE_SCALE_FACTOR
    latents_scale = 1.0  # per channel: scale_latents
    latents_shift = 0.0
    bucket_reso_multiple = VAE_SCALE_FACTOR * PATCH  # 16: latents packed in 2x2 patches
    supports_text_cache = True
    text_cache_suffix = "_qi_te.npz"
    block_classes = TRANSFORMER_TARGETS  # the repeated blocks FSDP wraps and --torch_compile compiles
    context_parallel_token_pixels = 16  # diffusers' QwenImageTransformer2DModel._cp_plan; text padded in predict
    tensor_parallel = True  # diffusers' QwenImageTransformer2DModel._tp_plan
    denoiser_leaves_weights_unused = True  # the last block's text stream (to_add_out, txt_mlp): nothing reads it

    # --- options -------------------------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.qwen_image.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.qwen_image.loading import write_qwen_image_preset

        check_folder_name(out, "Qwen-Image is written as a diffusers folder or as three ComfyUI files")
        return write_qwen_image_preset(preset, out, single_file)

    @classmethod
    def preset_hint(cls, written) -> str:
        if "folder" in written:
            return f"--pretrained_model_name_or_path {written['folder']}"
        return (f"--pretrained_model_name_or_path {written['dit']} --text_encoder {written['text_encoder']} "
                f"--vae {written['vae']}")

    def check_model_files(self, path: str, options: QwenImageOptions, vae: Optional[str],
                          blocks_to_swap: Optional[int]) -> None:
        check_model_source(path, options, vae)
        count = block_count(path) if blocks_to_swap else None
        if count and not 1 <= blocks_to_swap <= count - 2:
            raise ConfigError(f"--blocks_to_swap {blocks_to_swap}: expected 1..{count - 2} for this model "
                              f"({count} blocks; at most blocks - 2)")

    # Qwen-Image-Edit: control images (control_directory, --control_image / --ci) with --model_version edit*
    control_hint = "Qwen-Image takes control images with --model_version edit, edit-2509 or edit-2511"

    def max_control_images(self, options: Optional[QwenImageOptions]) -> int:
        """Edit: 1 (QwenImageEditPipeline takes one image); 2509 / 2511: 3 (the official limit); Qwen-Image: 0."""
        return options.max_controls if options is not None else 0

    def text_cache_values(self, options: Optional[QwenImageOptions]) -> dict[str, Any]:
        """The edit versions template captions differently (a cached entry of one does not serve another)."""
        version = options.version if options is not None else "original"
        return {"model_version": version} if version != "original" else {}

    def text_key(self, components: Components, caption: str, control_paths: tuple[str, ...]) -> str:
        """Qwen-Image-Edit: Qwen2.5-VL reads the control images with the caption, so they are part of the key
        (text.edit_key: their paths, sizes and mtimes)."""
        if not self.options(components).is_edit or not control_paths:
            return caption
        return text_rules.edit_key(caption, control_paths)

    # --- loading -------------------------------------------------------------------------------------
    def load_components(self, opts: LoadOptions, options: QwenImageOptions) -> Components:
        """A preset, a diffusers folder, or a DiT file with --text_encoder and --vae."""
        return load_components(opts, options)

    # --- text ----------------------------------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str],
                 max_token_length: Optional[int]) -> list[torch.Tensor]:
        """Captions, or for Qwen-Image-Edit text keys (text_key: a caption with its control images), as the
        pipeline tokenizes them (Edit: Qwen2VLProcessor with the images)."""
        options = self.options(components)
        if options.is_edit:
            return text_rules.tokenize_edit(components.tokenizers[0], captions, options.version)
        return text_rules.tokenize(components.tokenizers[0], captions)

    def encode_text(self, components: Components, tokens: list[torch.Tensor],
                    clip_skip: Optional[int]) -> TextConditioning:
        options = self.options(components)
        if options.is_edit:
            processor = components.tokenizers[0]
            return TextConditioning(text_rules.encode_edit(components.text_encoders[0], processor.tokenizer, tokens,
                                                           options.version))
        return TextConditioning(text_rules.encode(components.text_encoders[0], components.tokenizers[0], tokens))

    def check_loaded(self, components: Components, text: Any) -> None:
        if getattr(text, "clip_skip", None) is not None:
            raise ConfigError("--clip_skip: Qwen-Image uses Qwen2.5-VL's last hidden states; drop --clip_skip")

    # --- images --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae, images: torch.Tensor, generator=None) -> torch.Tensor:
        """Images in [-1, 1] (B,3,H,W) -> unnormalised latents (B,16,H/8,W/8): one frame through the video VAE."""
        from library.objectives.posterior import posterior_sample

        dist = vae.encode(images[:, :, None].to(vae.device, vae.dtype)).latent_dist
        if isinstance(generator, Sequence):
            latents = posterior_sample(dist, generator)
        else:
            latents = dist.sample(generator=generator).float()
        return latents[:, :, 0]

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(latents - latents_mean) / latents_std per channel, as the pipeline normalises them."""
        mean = torch.tensor(LATENTS_MEAN, device=latents.device, dtype=latents.dtype).view(1, -1, 1, 1)
        std = torch.tensor(LATENTS_STD, device=latents.device, dtype=latents.dtype).view(1, -1, 1, 1)
        return (latents - mean) / std

    def decode_latents(self, vae, latents: torch.Tensor) -> np.ndarray:
        """Normalised latents (B,16,h,w) -> uint8 images (B,H,W,3)."""
        from library.families.common.flow_sampling import borrowed_on

        config = vae.config
        mean = torch.tensor(config.latents_mean, device=latents.device).view(1, -1, 1, 1)
        std = torch.tensor(config.latents_std, device=latents.device).view(1, -1, 1, 1)
        latents = latents.float() * std + mean
        with borrowed_on(vae, latents.device):
            pixels = vae.decode(latents[:, :, None].to(vae.dtype)).sample[:, :, 0].float()
        pixels = torch.nan_to_num(pixels, nan=-1.0, posinf=1.0, neginf=-1.0)
        pixels = ((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        return (pixels * 255).round().astype(np.uint8)

    @staticmethod
    def rescale_guided(guided: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The pipeline's true-CFG rescale: each packed token scaled to the conditional prediction's norm."""
        h, w = guided.shape[-2:]
        g, c = pack(guided), pack(cond)
        g = g * (torch.norm(c, dim=-1, keepdim=True) / torch.norm(g, dim=-1, keepdim=True))
        return unpack(g, h, w)

    # --- denoising -----------------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> FlowMatchScheme:
        return FlowMatchScheme(self.options(components).flow)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        """The DiT's velocity (B,16,h,w) at t = σ (timesteps / 1000), text trimmed to the batch's longest caption.
        Reference latents (batch["scaled_control_latents"], Qwen-Image-Edit's) are packed after the target's, each
        with its own entry in img_shapes, as QwenImageEditPlusPipeline calls the DiT; only the target's tokens are
        returned."""
        model = components.denoiser
        device, dtype = noisy_latents.device, noisy_latents.dtype
        b, _, h, w = noisy_latents.shape
        split = getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None)  # diffusers'
        states, mask = text_rules.trimmed(text.tensors, split.ulysses_degree if split is not None else 1)
        controls = [c.to(device, dtype) for c in batch.get("scaled_control_latents") or []]
        tokens = torch.cat([pack(noisy_latents), *(pack(c) for c in controls)], dim=1)
        shapes = [(1, h // 2, w // 2), *((1, c.shape[-2] // 2, c.shape[-1] // 2) for c in controls)]
        out = model(hidden_states=tokens, timestep=(timesteps.float() / 1000).to(device, dtype),
                    encoder_hidden_states=states.to(device, dtype), encoder_hidden_states_mask=mask.to(device),
                    img_shapes=[shapes] * b, return_dict=False)[0]
        return unpack(out[:, :(h // 2) * (w // 2)], h, w)

    # --- generation ----------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        from library.families.qwen_image.generate import generate_qwen_image

        if components.vae is None:
            raise ConfigError("--vae: required to decode Qwen-Image images (vae/diffusion_pytorch_model.safetensors)")
        return generate_qwen_image(self, components, requests, device or components.denoiser.device)

    # --- LoRA ----------------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet: every Linear of the transformer blocks under its diffusers / ComfyUI name (musubi-tuner's
        networks.lora_qwen_image; img_mod / txt_mod left out unless --network_args exclude_mod=False); no text
        encoder LoRA."""
        return [LoraTarget("lora_unet", components.denoiser, TRANSFORMER_TARGETS, external_prefix="lycoris",
                           network_args=QwenImageNetworkArgs())]

    def convert_lora_state_dict(self, state_dict: dict) -> dict:
        """A ComfyUI- / ai-toolkit- / diffusers-named Qwen-Image LoRA renamed to kohya names; kohya and musubi-tuner
        files come back as they are."""
        return lora_names.to_kohya_lora(state_dict)

    # --- saving --------------------------------------------------------------------------------------
    # One .safetensors DiT file in ComfyUI's / Qwen's names (Qwen2.5-VL and the VAE are separate files).
    save_formats = ("safetensors",)

    def single_file_state_dict(self, components: Components) -> dict:
        from library.families.qwen_image.saving import dit_file_tensors

        return dit_file_tensors(components.denoiser)

    # --- memory --------------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        blocks = list(components.denoiser.transformer_blocks)
        if not 1 <= num_swap <= len(blocks) - 2:
            raise ConfigError(f"--blocks_to_swap {num_swap}: expected 1..{len(blocks) - 2} for this model "
                              f"({len(blocks)} blocks; at most blocks - 2)")
        return blocks[len(blocks) - num_swap:]

    def optimizer_block(self, parameter_path: str) -> Optional[str]:
        """`transformer_blocks.<i>` for a parameter inside a block, else `other`."""
        head, _, rest = parameter_path.partition(".")
        index = rest.partition(".")[0]
        return f"transformer_blocks.{index}" if head == "transformer_blocks" and index.isdigit() else "other"

    # --- metadata ------------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        # musubi-tuner's ss_base_model_version (its trainer's architecture_full_name): one name for every edit version
        return "qwen_image_edit" if self.options(components).is_edit else "qwen_image"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        # musubi-tuner's sai_model_spec ARCH_QWEN_IMAGE / _EDIT / _EDIT_PLUS (edit-2509) / _EDIT_2511
        return {"edit": "Qwen-Image-Edit", "edit-2509": "Qwen-Image-Edit-Plus",
                "edit-2511": "Qwen-Image-Edit-2511"}.get(self.options(components).version, "Qwen-Image")

    def modelspec_implementation(self) -> str:
        return QWEN_IMAGE_IMPLEMENTATION

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return "flow"
