"""The HunyuanImage 2.1 family: Tencent's 17B DiT (diffusers HunyuanImageTransformer2DModel), Qwen2.5-VL-7B and glyph
byT5 text, its 32x-down VAE, rectified flow; trained as sd-scripts' hunyuan_image_train_network.py trains it.

Text as sd-scripts (hunyuan_image/text.py): Qwen2.5-VL's third-to-last hidden states of the caption in its chat
template, and byT5 states of the caption's quoted text. Latents are the VAE's times 0.75289. The DiT is called with
t = ⌊σ·1000⌋ (sd-scripts casts the timestep to an integer) and predicts the velocity ε - x0 directly (sd-scripts'
default --model_prediction_type raw, target noise - latents).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from library.core.errors import ConfigError
from library.families.base import (
    Components,
    LoadOptions,
    TextConditioning,
    check_folder_name,
)
from library.families.common.flow_dit import FlowDiTFamily
from library.families.hunyuan_image import layout
from library.families.hunyuan_image import text as text_rules
from library.families.hunyuan_image.configs import (
    LATENT_CHANNELS,
    LATENT_SCALING_FACTOR,
    VAE_SCALE_FACTOR,
)
from library.families.hunyuan_image.loading import (
    block_counts,
    check_model_source,
    load_components,
)
from library.families.hunyuan_image.network_args import HunyuanImageNetworkArgs
from library.families.hunyuan_image.options import (
    COMPONENT_FILE_FLAGS,
    HunyuanImageOptions,
)
from library.objectives.flow import (
    FlowMatchScheme,
)
from networks.lora_targets import LoraTarget

logger = logging.getLogger(__name__)

HUNYUAN_IMAGE_IMPLEMENTATION = "https://github.com/Tencent-Hunyuan/HunyuanImage-2.1"  # sd-scripts' IMPL_HUNYUAN_IMAGE
# sd-scripts' networks/lora_hunyuan_image.py targets every Linear of MMDoubleStreamBlock and MMSingleStreamBlock.
TRANSFORMER_TARGETS = ("HunyuanImageTransformerBlock", "HunyuanImageSingleTransformerBlock")


def swap_split(num_swap: int, double: int, single: int) -> tuple[int, int]:
    """(double, single) blocks --blocks_to_swap N streams: N//2 and 2·(N − N//2), each at most its count − 2, as
    sd-scripts' HunyuanImage model allows (37 for 20 + 40 blocks); a one-line ConfigError beyond that."""
    fits = [n for n in range(1, 2 * (double + single) + 1) if n // 2 <= double - 2 and 2 * (n - n // 2) <= single - 2]
    if num_swap not in fits:
        limit = f"1..{fits[-1]}" if fits else "nothing"
        raise ConfigError(f"--blocks_to_swap {num_swap}: expected {limit} for this model ({double} double and {single} "
                          f"single blocks; N swaps N//2 double and 2*(N-N//2) single ones, at most blocks - 2 of each)")
    return num_swap // 2, 2 * (num_swap - num_swap // 2)


class HunyuanImageFamily(FlowDiTFamily):
    """HunyuanImage 2.1 (tencent/HunyuanImage-2.1)."""

    name = "hunyuan_image"
    display_name = "HunyuanImage"
    # what sd-scripts' HunyuanImageNetworkTrainer.update_metadata records
    metadata_flow_keys = ("logit_mean", "logit_std", "mode_scale", "timestep_sampling", "sigmoid_scale",
                          "model_prediction_type", "discrete_flow_shift")
    ignored_flags_note = "switches of sd-scripts' own HunyuanImage code that change nothing with diffusers' models here"
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 10
    single_file_markers = ("double_blocks.0.img_attn_qkv.",
                           "model.diffusion_model.double_blocks.0.img_attn_qkv.")
    contents = (("byt5_in.", "a HunyuanImage 2.1 DiT"),
                ("model.diffusion_model.byt5_in.", "a HunyuanImage 2.1 DiT"),
                ("model.layers.0.self_attn.q_proj.bias", "a Qwen2.5-VL text encoder"))
    diffusers_class_markers = ()
    scripts = {"lora": "hunyuan_image_train_network.py"}
    text_encoder_labels = ("Text encoder (Qwen2.5-VL)", "Text encoder 2 (byT5)")
    denoiser_label = "DiT"
    component_file_flags = COMPONENT_FILE_FLAGS
    flag_aliases = (("fp8_scaled", "fp8_base_unet"),)
    tiny_presets = ("tiny:hunyuan_image",)
    options_type = HunyuanImageOptions
    lora_network_module = "networks.lora_hunyuan_image"  # what sd-scripts' hunyuan_image_train_network.py files say
    latent_cache_arch = "_hi"  # sd-scripts' `<image>_<w>x<h>_hi.npz`
    latent_cache_key_stride = VAE_SCALE_FACTOR
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = VAE_SCALE_FACTOR
    latents_scale = LATENT_SCALING_FACTOR
    latents_shift = 0.0
    ae_scale, ae_shift = LATENT_SCALING_FACTOR, 0.0  # for common/flow_sampling.py decode_images
    bucket_reso_multiple = 32  # sd-scripts: verify_bucket_reso_steps(32)
    supports_text_cache = True
    text_cache_suffix = "_hi_te.npz"
    block_classes = TRANSFORMER_TARGETS  # the repeated blocks FSDP wraps and --torch_compile compiles

    # --- options -------------------------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.hunyuan_image.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.hunyuan_image.loading import write_hunyuan_image_preset

        check_folder_name(out, "HunyuanImage is written as four files")
        return write_hunyuan_image_preset(preset, out)

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        return (f"--pretrained_model_name_or_path {written['dit']} --text_encoder {written['text_encoder']} "
                f"--byt5 {written['byt5']} --vae {written['vae']}")

    def check_model_files(self, path: str, options: HunyuanImageOptions, vae: Optional[str],
                          blocks_to_swap: Optional[int]) -> None:
        check_model_source(path, options, vae)
        counts = block_counts(path) if blocks_to_swap else None
        if counts:
            swap_split(blocks_to_swap, *counts)

    # --- loading -------------------------------------------------------------------------------------
    def load_components(self, opts: LoadOptions, options: HunyuanImageOptions) -> Components:
        """The preset tiny:hunyuan_image / random:hunyuan_image, or an original DiT file with --text_encoder, --byt5
        and --vae."""
        return load_components(opts, options)

    # --- text ----------------------------------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str],
                 max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[Qwen ids, mask, byT5 ids, mask] (hunyuan_image/text.py tokenize)."""
        return text_rules.tokenize(components.tokenizers[0], components.tokenizers[1], captions)

    def encode_text(self, components: Components, tokens: list[torch.Tensor],
                    clip_skip: Optional[int]) -> TextConditioning:
        """vlm_embed / vlm_mask / byt5_embed / byt5_mask / ocr_mask (the keys of sd-scripts' `_hi_te.npz`)."""
        qwen, byt5 = components.text_encoders
        return TextConditioning(text_rules.encode(qwen, byt5, components.tokenizers[0], tokens))

    def check_loaded(self, components: Components, text: Any) -> None:
        if getattr(text, "clip_skip", None) is not None:
            raise ConfigError("--clip_skip: HunyuanImage uses Qwen2.5-VL's third-to-last hidden states; drop --clip_skip")

    # --- denoising -----------------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> FlowMatchScheme:
        return FlowMatchScheme(self.options(components).flow)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        """The DiT's velocity at t = ⌊σ·1000⌋, text trimmed to the batch's longest caption."""
        model = components.denoiser
        device, dtype = noisy_latents.device, noisy_latents.dtype
        vlm, vlm_mask, byt5, byt5_mask = text_rules.trimmed(text.tensors)
        return model(hidden_states=noisy_latents, timestep=timesteps.float().floor().to(device, dtype),
                     encoder_hidden_states=vlm.to(device, dtype), encoder_attention_mask=vlm_mask.to(device),
                     encoder_hidden_states_2=byt5.to(device, dtype), encoder_attention_mask_2=byt5_mask.to(device),
                     return_dict=False)[0]

    # --- generation ----------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        from library.families.hunyuan_image.generate import generate_hunyuan_image

        if components.vae is None:
            raise ConfigError("--vae: required to decode HunyuanImage images (hunyuan_image_2.1_vae_fp16.safetensors)")
        return generate_hunyuan_image(self, components, requests, device or components.denoiser.device)

    # --- LoRA ----------------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet: every Linear of the double and single blocks under its original name (q, k, v fused as
        `img_attn_qkv` / `txt_attn_qkv`, a single block's q, k, v and MLP input as `linear1`); no text encoder
        LoRA (sd-scripts' networks/lora_hunyuan_image.py has none)."""
        return [LoraTarget("lora_unet", components.denoiser, TRANSFORMER_TARGETS, rename=layout.original_path,
                           fused_slot=layout.fused_slot, external_prefix="lycoris",
                           network_args=HunyuanImageNetworkArgs())]

    def convert_lora_state_dict(self, state_dict: dict) -> dict:
        """A ComfyUI-named HunyuanImage LoRA (sd-scripts' convert_hunyuan_image_lora_to_comfy.py output) renamed to
        sd-scripts' names; a file already in them comes back as it is."""
        renamed = {}
        for key, value in state_dict.items():
            name, dot, rest = key.partition(".")
            renamed[layout.kohya_lora_name(name) + dot + rest] = value
        return state_dict if renamed.keys() == state_dict.keys() else renamed

    def canonical_lora_name(self, name: str) -> str:
        return layout.kohya_lora_name(name)

    # --- saving --------------------------------------------------------------------------------------
    # One .safetensors DiT file in the original names (Qwen2.5-VL, byT5 and the VAE are separate files).
    save_formats = ("safetensors",)

    def single_file_state_dict(self, components: Components) -> dict:
        return layout.to_original(components.denoiser.state_dict())

    # --- memory --------------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        """sd-scripts' rule: N swaps the last N//2 double and 2·(N − N//2) single blocks, in forward order."""
        model = components.denoiser
        double, single = list(model.transformer_blocks), list(model.single_transformer_blocks)
        n_double, n_single = swap_split(num_swap, len(double), len(single))
        return double[len(double) - n_double:] + single[len(single) - n_single:]

    def optimizer_block(self, parameter_path: str) -> Optional[str]:
        """`double_blocks.<i>` / `single_blocks.<i>` for a parameter inside a block, else `other`."""
        head, _, rest = parameter_path.partition(".")
        index = rest.partition(".")[0]
        if head in ("transformer_blocks", "single_transformer_blocks") and index.isdigit():
            return f"{'double' if head == 'transformer_blocks' else 'single'}_blocks.{index}"
        return "other"

    # --- metadata ------------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        return "hunyuan-image-2.1"  # sd-scripts' hunyuan_image_utils.MODEL_VERSION_2_1

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "hunyuan-image-2.1"  # sd-scripts' sai_model_spec.ARCH_HUNYUAN_IMAGE_2_1

    def modelspec_implementation(self) -> str:
        return HUNYUAN_IMAGE_IMPLEMENTATION

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return "epsilon"  # sd-scripts names none only for FLUX.1
