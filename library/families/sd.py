"""The Stable Diffusion 1.x / 2.x family: one family, v2 read from the loaded model.

Text handling follows sd-scripts: prompts longer than 75 tokens (with
--max_token_length 150 / 225) are split into 75-token chunks, each wrapped in
BOS/EOS and encoded separately, and the chunk outputs are joined back into one
sequence of max_token_length + 2 states.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from library.errors import ConfigError
from library.families.base import Components, LoadOptions, LoraTarget, ModelFamily, TextConditioning

ALLOWED_MAX_TOKEN_LENGTHS = (None, 75, 150, 225)
UNET_TARGETS = ("Transformer2DModel",)
UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
# transformers 5 has only CLIPAttention; older releases also have CLIPSdpaAttention.
TEXT_ENCODER_TARGETS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")


def check_max_token_length(max_token_length: Optional[int]) -> int:
    """Validate --max_token_length and return the number of prompt tokens (75, 150 or 225)."""
    if max_token_length not in ALLOWED_MAX_TOKEN_LENGTHS:
        raise ConfigError(f"--max_token_length: expected 75, 150 or 225 (or unset), got {max_token_length!r}")
    return max_token_length or 75


def chunk_token_ids(tokenizer, captions: list[str], max_token_length: Optional[int]) -> torch.Tensor:
    """Tokenise captions into (B, n_chunks * 77) ids: n_chunks = max_token_length / 75 windows.

    Each window is BOS + 75 ids + EOS. With a tokenizer that pads with its own
    token (SD2), a window that ends mid-text gets EOS as its last id and a window
    that is only padding starts with BOS EOS, as in sd-scripts.
    """
    n_tokens = check_max_token_length(max_token_length)
    window = tokenizer.model_max_length  # 77
    inner = window - 2
    ids = tokenizer(captions, padding="max_length", truncation=True, max_length=n_tokens + 2,
                    return_tensors="pt").input_ids
    if n_tokens == inner:
        return ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks = []
    for start in range(1, n_tokens + 1, inner):
        chunk = torch.cat([ids[:, :1], ids[:, start:start + inner], ids[:, -1:]], dim=1)
        if pad != eos:
            ends_mid_text = (chunk[:, -2] != eos) & (chunk[:, -2] != pad)
            chunk[ends_mid_text, -1] = eos
            chunk[chunk[:, 1] == pad, 1] = eos
        chunks.append(chunk)
    return torch.cat(chunks, dim=1)


def final_layer_norm(text_encoder):
    """The final LayerNorm of a CLIPTextModel (transformers 5 dropped the `text_model` level)."""
    inner = getattr(text_encoder, "text_model", text_encoder)
    return inner.final_layer_norm


def text_encoder_kohya_path(path: str) -> str:
    """Module path as kohya names it: always under `text_model.` (lora_te_text_model_encoder_...)."""
    return path if path.startswith("text_model.") else "text_model." + path


def encode_token_chunks(text_encoder, tokens: torch.Tensor, clip_skip: Optional[int],
                        window: int = 77) -> torch.Tensor:
    """Encode (B, n*77) ids chunk by chunk; return (B, n*75 + 2, D) hidden states.

    clip_skip k > 1 takes the k-th hidden state from the end and applies the final
    layer norm (for SD2 too, as sd-scripts does).
    """
    batch = tokens.shape[0]
    flat = tokens.reshape(-1, window).to(text_encoder.device)
    if clip_skip is None or clip_skip <= 1:
        states = text_encoder(flat)[0]
    else:
        out = text_encoder(flat, output_hidden_states=True, return_dict=True)
        states = final_layer_norm(text_encoder)(out.hidden_states[-clip_skip])
    return join_token_chunks(states.reshape(batch, -1, states.shape[-1]), window)


def join_token_chunks(states: torch.Tensor, window: int = 77) -> torch.Tensor:
    """(B, n*77, D) per-chunk states -> (B, n*75 + 2, D): BOS of the first chunk, inner states, EOS of the last."""
    n_chunks = states.shape[1] // window
    if n_chunks == 1:
        return states
    # BOS state of the first chunk, the inner states of every chunk, EOS state of the last.
    parts = [states[:, :1]]
    for c in range(n_chunks):
        parts.append(states[:, c * window + 1:(c + 1) * window - 1])
    parts.append(states[:, -1:])
    return torch.cat(parts, dim=1)


class SDFamily(ModelFamily):
    """Stable Diffusion 1.x and 2.x (incl. v-prediction): UNet2DConditionModel + one CLIP text encoder."""

    name = "sd"
    latent_cache_arch = "_sd"
    latent_channels = 4
    vae_scale_factor = 8
    latents_scale = 0.18215
    latents_shift = 0.0
    bucket_reso_multiple = 64

    def load(self, opts: LoadOptions) -> Components:
        """Load a diffusers folder, a single-file checkpoint, a hub id from the local cache, or a preset."""
        from library.families.loading import load_sd_components

        return load_sd_components(opts)

    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        return [chunk_token_ids(components.tokenizers[0], captions, max_token_length)]

    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        window = components.tokenizers[0].model_max_length
        states = encode_token_chunks(components.text_encoders[0], tokens[0], clip_skip, window)
        return TextConditioning(tensors={"encoder_hidden_states": states})

    def noise_scheme(self, components: Components, **options: Any):
        from library.train.noise import DDPMScheme

        return DDPMScheme(prediction_type="v_prediction" if components.v_parameterization else "epsilon",
                          zero_terminal_snr=options.get("zero_terminal_snr", False))

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        hidden = text.tensors["encoder_hidden_states"]
        return components.denoiser(noisy_latents, timesteps, hidden).sample

    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        from library.families.sd_generate import generate_sd

        return generate_sd(self, components, requests, clip_skip, device or components.denoiser.device)

    def lora_targets(self, components: Components) -> list[LoraTarget]:
        return [
            LoraTarget("lora_unet", components.denoiser, UNET_TARGETS, UNET_CONV_TARGETS),
            LoraTarget("lora_te", components.text_encoders[0], TEXT_ENCODER_TARGETS, is_text_encoder=True,
                       rename=text_encoder_kohya_path),
        ]

    def save_checkpoint(self, components: Components, path: str, dtype: Optional[torch.dtype] = None) -> None:
        from library.families import sd_saving

        unet, vae, te = components.denoiser, components.vae, components.text_encoders[0]
        if path.lower().endswith((".safetensors", ".ckpt")):
            sd_saving.save_single_file(unet, vae, te, path, components.v2, dtype)
            return
        if dtype is not None:
            for part in (unet, vae, te):
                part.to(dtype=dtype)
        sd_saving.save_diffusers_folder(unet, vae, te, components.tokenizers[0], path, components.v_parameterization)

    def base_model_version(self, components: Components) -> str:
        if not components.v2:
            return "sd_v1"
        return "sd_v2_v" if components.v_parameterization else "sd_v2"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        if not components.v2:
            return "stable-diffusion-v1"
        return "stable-diffusion-v2-768-v" if components.v_parameterization else "stable-diffusion-v2-512"
