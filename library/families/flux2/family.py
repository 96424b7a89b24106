"""The FLUX.2 family (Black Forest Labs FLUX.2 [klein] 4B / 9B and their base models, FLUX.2 [dev]): the MMDiT
(diffusers Flux2Transformer2DModel), Qwen3 text (klein) or Mistral-Small-3.1 text with a guidance embedding (dev), the
32-channel FLUX.2 AE, rectified flow; LoRA files in the kohya names of BFL's modules, which ComfyUI and diffusers'
Flux2 pipelines load.

Text of dev as diffusers' Flux2Pipeline: BFL's system prompt and the caption as a user turn through the tokenizer's own
chat template (apply_chat_template, no generation prompt), padded to --mistral3_max_token_length (default 512),
Mistral's hidden states after layers 10, 20 and 30 side by side; the guidance value (--guidance_scale, default 1.0 as
musubi-tuner trains; generation's --g) goes to the guidance embedding.

Text as diffusers' Flux2KleinPipeline: each caption in Qwen3's chat template (one user turn, the assistant turn opened
with an empty thinking block), padded right to --qwen3_max_token_length (default 512), Qwen3's hidden states after
layers 9, 18 and 27 side by side (`hidden_state`, with `input_ids` and `attention_mask`); the DiT takes every token
(the pipeline passes no mask), text positions (0, 0, 0, i). Latents are the AE's 32 channels at 1/8 size, normalised
by the AE's batch-norm statistics of their 2x2 patches (the pipeline's patchify + (x - mean) / std, kept in the
unpatchified layout); the DiT sees them as 2x2 patches (128 features a token) at positions (0, row, column, 0).
It is called with t = σ (timesteps / 1000) and predicts the velocity ε - x0 (the pipeline's scheduler step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Mapping, Optional

import numpy as np
import torch

from library.core.errors import ConfigError
from library.families.base import Components, LoadOptions, TextConditioning, check_folder_name
from library.families.common.flow_dit import FlowDiTFamily
from library.families.common.llm_text import TEXT_KEYS as LLM_TEXT_KEYS
from library.families.common.swap_rules import check_last_blocks_swap, last_blocks
from library.families.flux2 import layout
from library.families.flux2.configs import (CHAT_TEMPLATE, LATENT_CHANNELS, MISTRAL_TEXT_LAYERS, SYSTEM_MESSAGE,
                                            TEXT_LAYERS)
from library.families.flux2.generate import generate_flux2
from library.families.flux2.loading import block_counts, check_model_source, load_flux2_components
from library.families.flux2.options import COMPONENT_FILE_FLAGS, Flux2Options
from library.objectives.flow import FlowMatchScheme
from networks.lora_targets import LoraTarget

logger = logging.getLogger(__name__)

FLUX2_IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"
# musubi-tuner's networks/lora_flux_2.py: the double- and single-stream blocks (their Linears: attention, MLP; the
# modulation is outside the blocks in FLUX.2); Qwen3's attention and MLP.
TRANSFORMER_TARGETS = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")
QWEN3_TARGETS = ("Qwen3Attention", "Qwen3MLP")
MISTRAL_TARGETS = ("MistralAttention", "MistralMLP")


def is_dev(components: Components) -> bool:
    """FLUX.2 [dev] (Mistral text, guidance) rather than klein: from the text encoder, else the DiT."""
    encoder = components.text_encoders[0] if components.text_encoders else None
    if encoder is not None:
        return encoder.config.model_type in ("mistral", "mistral3")
    return bool(components.denoiser is not None and components.denoiser.config.guidance_embeds)


def dev_messages(captions: list[str]) -> list[list[dict]]:
    """Flux2Pipeline's format_input without images: the system prompt, then the caption ([IMG] removed) as a user
    turn, content as typed text blocks."""
    return [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
             {"role": "user", "content": [{"type": "text", "text": c.replace("[IMG]", "")}]}] for c in captions]


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2), the pipeline's _patchify_latents."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, 4C, h, w) -> (B, C, 2h, 2w), the pipeline's _unpatchify_latents."""
    b, c4, h, w = latents.shape
    return latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


def bn_stats(vae, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) (1, 128, 1, 1) of the AE's batch norm over the 2x2 patches, as the pipeline computes them."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(device, dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(device, dtype)
    return mean, std


REFERENCE_TIME_SCALE = 10  # the pipelines' _prepare_image_ids: reference i at time offset 10 + 10·i
MAX_REFERENCES = 3  # the dataset's limit (library/data/control_images.py); the pipelines take any number


def reference_tokens(controls: Sequence[torch.Tensor], device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.2's reference images (each (B, 32, h, w), normalised) as tokens (B, N, 128) after the target's, with
    position ids (B, N, 4) = (10 + 10·i, row, column, 0): the pipelines' prepare_image_latents / _prepare_image_ids."""
    tokens, ids = [], []
    for i, control in enumerate(controls):
        patches = patchify(control.to(device, dtype))
        b, c4, h, w = patches.shape
        tokens.append(patches.reshape(b, c4, h * w).permute(0, 2, 1))
        t = torch.tensor([REFERENCE_TIME_SCALE * (i + 1)])
        ids.append(torch.cartesian_prod(t, torch.arange(h), torch.arange(w), torch.arange(1)).expand(b, -1, -1))
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=1).to(device)


def position_ids(h: int, w: int, text_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(image ids (h·w, 4) = (0, row, column, 0), text ids (L, 4) = (0, 0, 0, i)): the pipeline's
    _prepare_latent_ids / _prepare_text_ids of one sample (the DiT takes one set for the batch)."""
    zero = torch.arange(1)
    image = torch.cartesian_prod(zero, torch.arange(h), torch.arange(w), zero)
    text = torch.cartesian_prod(zero, zero, zero, torch.arange(text_tokens))
    return image.to(device), text.to(device)


class Flux2Family(FlowDiTFamily):
    """FLUX.2 [klein] (black-forest-labs/FLUX.2-klein-4B, -9B, -base-4B, -base-9B)."""

    name = "flux2"
    display_name = "FLUX.2"
    metadata_flow_keys = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling",
                          "sigmoid_scale", "model_prediction_type", "discrete_flow_shift")
    # Before FLUX.1 (both have `double_blocks.`): only FLUX.2 has the shared `single_stream_modulation`.
    detect_rank = 45
    single_file_markers = ("single_stream_modulation.lin.", "model.diffusion_model.single_stream_modulation.lin.")
    contents = (("single_stream_modulation.lin.", "a FLUX.2 DiT"),
                ("model.diffusion_model.single_stream_modulation.lin.", "a FLUX.2 DiT"))
    diffusers_class_markers = ("Flux2",)
    scripts = {"lora": "flux2_train_network.py", "finetune": "flux2_train.py"}
    text_encoder_labels = ("Text encoder (Qwen3; Mistral for dev)",)
    denoiser_label = "DiT"
    component_file_flags = COMPONENT_FILE_FLAGS
    tiny_presets = ("tiny:flux2", "tiny:flux2_dev")
    options_type = Flux2Options
    lora_network_module = "networks.lora_flux2"
    latent_cache_arch = "_flux2"
    block_classes = TRANSFORMER_TARGETS  # the repeated blocks FSDP wraps and --torch_compile compiles
    latent_cache_key_stride = 8
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = 8
    latents_scale = 1.0  # encode_images already applies the AE's batch norm
    latents_shift = 0.0
    bucket_reso_multiple = 16  # 8x AE, 2x2 patches
    context_parallel_token_pixels = 16  # diffusers' Flux2Transformer2DModel._cp_plan; text padded to a fixed length
    tensor_parallel = True  # diffusers' Flux2Transformer2DModel._tp_plan
    supports_text_cache = True
    text_cache_suffix = "_flux2_te.npz"
    TEXT_KEYS = LLM_TEXT_KEYS

    # --- options -------------------------------------------------------------------------------------
    control_hint = "FLUX.2 takes up to 3 reference images per target"

    def max_control_images(self, options: Optional[Flux2Options]) -> int:
        """Reference images (control_directory): up to 3 each, as extra tokens with their own time offsets (klein's
        and dev's pipelines both take a list of reference images)."""
        return MAX_REFERENCES

    @classmethod
    def presets(cls) -> dict:
        from library.families.flux2.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.flux2.loading import write_flux2_preset

        check_folder_name(out, "FLUX.2 is written as a diffusers folder and ComfyUI's three files")
        return write_flux2_preset(preset, out)

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        flag = "mistral3" if "mistral3" in written else "qwen3"
        return (f"--pretrained_model_name_or_path {written['diffusers']}  (or {written['dit']} --{flag} "
                f"{written[flag]} --ae {written['ae']})")

    def check_model_files(self, path: str, options: Flux2Options, vae: Optional[str],
                          blocks_to_swap: Optional[int]) -> None:
        check_model_source(path, options, vae)
        counts = block_counts(path) if blocks_to_swap else None
        if counts:
            check_last_blocks_swap(blocks_to_swap, counts[1], "single-stream blocks")

    def text_cache_values(self, options: Flux2Options) -> dict[str, Any]:
        return {"qwen3": options.qwen3, "qwen3_max_token_length": options.max_tokens, "mistral3": options.mistral3,
                "mistral3_max_token_length": options.mistral_max_tokens}

    def metadata_values(self, options: Flux2Options) -> dict[str, Any]:
        return {**super().metadata_values(options), "guidance_scale": options.guidance_scale}

    # --- loading -------------------------------------------------------------------------------------
    def load_components(self, opts: LoadOptions, options: Flux2Options) -> Components:
        """The preset tiny:flux2 / random:flux2, a diffusers folder, or an original DiT file with --qwen3 and --ae."""
        return load_flux2_components(opts, options)

    # --- text ----------------------------------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str],
                 max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[ids, mask] (B, length) of each caption in the chat template: klein's Qwen3 one
        (--qwen3_max_token_length), dev's Mistral one with the system prompt (--mistral3_max_token_length)."""
        tokenizer = components.tokenizers[0]
        if is_dev(components):
            out = tokenizer.apply_chat_template(dev_messages(captions), add_generation_prompt=False, tokenize=True,
                                                return_dict=True, return_tensors="pt", padding="max_length",
                                                truncation=True,
                                                max_length=self.options(components).mistral_max_tokens)
            return [out["input_ids"], out["attention_mask"]]
        out = tokenizer([CHAT_TEMPLATE.format(c) for c in captions], padding="max_length", truncation=True,
                        max_length=self.options(components).max_tokens, return_tensors="pt")
        return [out.input_ids, out.attention_mask]

    def encode_text(self, components: Components, tokens: list[torch.Tensor],
                    clip_skip: Optional[int]) -> TextConditioning:
        """The text encoder's hidden states after layers 9, 18, 27 (klein's Qwen3) or 10, 20, 30 (dev's Mistral),
        side by side per token (B, L, 3·hidden), the ids and the mask (as the pipelines' _get_qwen3_prompt_embeds /
        _get_mistral_3_small_prompt_embeds)."""
        encoder = components.text_encoders[0]
        dev = is_dev(components)
        layers, flag = (MISTRAL_TEXT_LAYERS, "--mistral3") if dev else (TEXT_LAYERS, "--qwen3")
        ids, mask = (t.to(encoder.device) for t in tokens)
        hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        if len(hidden) <= max(layers):
            raise ConfigError(f"{flag}: FLUX.2 reads the text encoder's layers {layers}; this encoder has "
                              f"{len(hidden) - 1} layers")
        out = torch.stack([hidden[k] for k in layers], dim=1)
        b, n, length, width = out.shape
        states = out.permute(0, 2, 1, 3).reshape(b, length, n * width)
        return TextConditioning(dict(zip(LLM_TEXT_KEYS, (states, ids, mask))))

    def check_loaded(self, components: Components, text: Any) -> None:
        if getattr(text, "clip_skip", None) is not None:
            raise ConfigError("--clip_skip: FLUX.2 reads fixed text-encoder layers (9, 18, 27 of Qwen3; 10, 20, 30 "
                              "of Mistral); drop --clip_skip")

    # --- images --------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae, images: torch.Tensor,
                      generator: Optional[torch.Generator | Sequence[torch.Generator]] = None) -> torch.Tensor:
        """Images in [-1, 1] -> AE latents normalised by its batch norm over 2x2 patches, float32 (B, 32, H/8, W/8).

        The pipeline encodes with the posterior's mode (argmax) for reference images; training draws from the
        posterior as every family here does."""
        return self.normalize_latents(vae, super().encode_images(vae, images, generator))

    def normalize_latents(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Raw AE latents (B, 32, h, w) -> (patchify(x) - bn mean) / bn std, unpatchified."""
        mean, std = bn_stats(vae, latents.device, latents.dtype)
        return unpatchify((patchify(latents) - mean) / std)

    def denormalize_latents(self, vae, latents: torch.Tensor) -> torch.Tensor:
        mean, std = bn_stats(vae, latents.device, latents.dtype)
        return unpatchify(patchify(latents) * std + mean)

    def decode_latents(self, vae, latents: torch.Tensor) -> np.ndarray:
        """Normalised latents (B, 32, h, w) -> uint8 images (B, H, W, 3)."""
        from library.families.common.flow_sampling import borrowed_on

        if vae is None:
            raise ConfigError("--ae: required to decode FLUX.2 images (flux2-vae.safetensors)")
        with borrowed_on(vae, latents.device):
            raw = self.denormalize_latents(vae, latents.float())
            pixels = vae.decode(raw.to(vae.dtype)).sample.float()
        if not torch.isfinite(pixels).all():
            logger.warning("generated image has NaN/inf values (fp16 overflow?); they are drawn black. Try bf16")
            pixels = torch.nan_to_num(pixels, nan=-1.0, posinf=1.0, neginf=-1.0)
        pixels = ((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        return (pixels * 255).round().astype(np.uint8)

    # --- denoising -----------------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> FlowMatchScheme:
        return FlowMatchScheme(self.options(components).flow)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        """The velocity ε - x0 (B, 32, h, w): the DiT at t = σ on the 2x2 patches of the latents and every text
        token. Reference images (batch["scaled_control_latents"], control_directory / --control_image) go after the
        target's tokens at time offsets 10, 20, 30 (the pipelines'), their output dropped. dev's guidance
        embedding gets batch["guidance"] (B,) (generation's --g), else --guidance_scale."""
        model = components.denoiser
        device, dtype = noisy_latents.device, noisy_latents.dtype
        b, c, h, w = noisy_latents.shape
        patches = patchify(noisy_latents)
        tokens = patches.reshape(b, c * 4, -1).permute(0, 2, 1)
        states = text.tensors["hidden_state"].to(device, dtype)
        img_ids, txt_ids = position_ids(h // 2, w // 2, states.shape[1], device)
        guidance = None
        if model.config.guidance_embeds:
            given = batch.get("guidance")
            guidance = given.to(device, dtype) if given is not None else \
                torch.full((b,), self.options(components).guidance_scale, device=device, dtype=dtype)
        # batched (B, L, 4), as the pipeline passes them and the model's context-parallel plan splits them
        img_ids = img_ids.expand(b, -1, -1)
        controls = batch.get("scaled_control_latents") or []
        model_in = tokens
        if controls:
            ref_tokens, ref_ids = reference_tokens(controls, device, dtype)
            model_in = torch.cat([tokens, ref_tokens], dim=1)
            img_ids = torch.cat([img_ids, ref_ids], dim=1)
        out = model(hidden_states=model_in, encoder_hidden_states=states,
                    timestep=(timesteps.float() / 1000).to(device, dtype), img_ids=img_ids,
                    txt_ids=txt_ids.expand(b, -1, -1), guidance=guidance, return_dict=False)[0]
        out = out[:, : tokens.shape[1]]
        return unpatchify(out.permute(0, 2, 1).reshape(b, c * 4, h // 2, w // 2))

    # --- generation ----------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        if components.vae is None:
            raise ConfigError("--ae: required to decode FLUX.2 images (flux2-vae.safetensors)")
        return generate_flux2(self, components, requests, device or components.denoiser.device)

    # --- LoRA ----------------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet: the double / single blocks' Linears under BFL's (ComfyUI) names, q, k, v fused as
        `img_attn_qkv` / `txt_attn_qkv`; lora_te: the text encoder's attention and MLP (Qwen3's or Mistral's)."""
        targets = [LoraTarget("lora_unet", components.denoiser, TRANSFORMER_TARGETS, rename=layout.original_path,
                              fused_slot=layout.fused_slot, external_prefix="lycoris")]
        if components.text_encoders and components.text_encoders[0] is not None:
            classes = MISTRAL_TARGETS if is_dev(components) else QWEN3_TARGETS
            targets.append(LoraTarget("lora_te", components.text_encoders[0], classes, is_text_encoder=True))
        return targets

    def convert_lora_state_dict(self, state_dict: dict) -> dict:
        """An ai-toolkit- / ComfyUI- / diffusers-named FLUX.2 LoRA renamed to kohya names; kohya and musubi-tuner
        files come back as they are."""
        from library.families.flux2.lora_names import to_kohya_lora

        return to_kohya_lora(state_dict)

    # --- saving --------------------------------------------------------------------------------------
    # One .safetensors DiT file in BFL's (ComfyUI) names; Qwen3 and the AE unchanged.
    save_formats = ("safetensors",)

    def single_file_state_dict(self, components: Components) -> dict:
        return layout.to_original(components.denoiser.state_dict())

    # --- memory --------------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        """The last N single-stream blocks; at most blocks - 2."""
        return last_blocks(list(components.denoiser.single_transformer_blocks), num_swap, "single-stream blocks")

    def optimizer_block(self, parameter_path: str) -> Optional[str]:
        """`transformer_blocks.<i>` / `single_transformer_blocks.<i>` for a parameter inside a block, else `other`."""
        head, _, rest = parameter_path.partition(".")
        index = rest.partition(".")[0]
        if head in ("transformer_blocks", "single_transformer_blocks") and index.isdigit():
            return f"{head}.{index}"
        return "other"

    # --- metadata ------------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        return "flux2"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "flux-2-dev" if components.denoiser.config.guidance_embeds else "flux-2-klein"

    def modelspec_implementation(self) -> str:
        return FLUX2_IMPLEMENTATION

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return None  # a flow model: sd-scripts writes no prediction type (as FLUX.1)
