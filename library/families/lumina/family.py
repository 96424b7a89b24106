"""The Lumina Image 2.0 family: NextDiT 2B (diffusers Lumina2Transformer2DModel), Gemma-2 2B text, the FLUX.1 AE,
rectified flow, trained as sd-scripts' lumina_train_network.py trains it.

Text as sd-scripts: `<system prompt> <Prompt Start> ` + caption (nothing when --system_prompt is empty), Gemma
tokens padded right to --gemma2_max_token_length (default 256), Gemma-2's second-to-last hidden states and the
mask (`hidden_state`, `input_ids`, `attention_mask`: the keys of sd-scripts' `_lumina_te.npz`). Latents are the
FLUX.1 AE's (x - 0.1159) · 0.3611. The model is called with t = 1 - σ and predicts x0 - ε (sd-scripts' target);
predict returns its negation, the velocity ε - x0 of the project's flow scheme.
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
from library.families.common.flow_dit import FlowDiTFamily, FluxAELatents
from library.families.common.llm_text import TEXT_KEYS as LLM_TEXT_KEYS
from library.families.common.llm_text import second_to_last_states
from library.families.common.swap_rules import check_last_blocks_swap, last_blocks
from library.families.lumina import layout
from library.families.lumina.configs import LATENT_CHANNELS
from library.families.lumina.generate import generate_lumina
from library.families.lumina.loading import (
    block_count,
    check_model_source,
    load_lumina_components,
)
from library.families.lumina.network_args import LuminaNetworkArgs, embedder_targets
from library.families.lumina.options import COMPONENT_FILE_FLAGS, LuminaOptions
from library.objectives.flow import (
    FlowMatchScheme,
    flux_shift_mu,
    time_shift,
)
from library.objectives.noise import rand
from networks.lora_targets import LoraTarget

logger = logging.getLogger(__name__)

LUMINA_IMPLEMENTATION = "https://github.com/Alpha-VLLM/Lumina-Image-2.0"  # sd-scripts' IMPL_LUMINA
# sd-scripts' networks/lora_lumina.py targets: JointTransformerBlock (-> Lumina2TransformerBlock: the joint layers
# and both refiners) and FinalLayer (-> norm_out, LuminaLayerNormContinuous: final adaLN and linear); Gemma-2's
# attention and MLP.
TRANSFORMER_TARGETS = ("Lumina2TransformerBlock", "LuminaLayerNormContinuous")
GEMMA2_TARGETS = ("Gemma2Attention", "Gemma2MLP")


class LuminaFlowScheme(FlowMatchScheme):
    """FLUX.1's rectified flow plus sd-scripts' Lumina-only sampler nextdit_shift: σ uniform (at least 1e-7), then
    shifted by μ of the image's 2x2-patch count (FLUX.1's resolution shift), and sd-scripts' Lumina meaning of
    --model_prediction_type."""

    def prediction(self, model_output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """sd-scripts' lumina_train_util.apply_model_prediction_type, in this loop's sign convention.

        sd-scripts compares f(out) with x0 − ε, where out is NextDiT's own output (an x0 − ε estimate) and f is
        raw: out, additive: out + x_σ, sigma_scaled: x_σ − σ·out. Here `model_output` is the velocity −out
        (LuminaFamily.predict) and the target ε − x0, so returning −f(out) gives the same residual up to sign:
        the same loss, element by element. (additive and sigma_scaled are FLUX.1's formulas applied to a model that
        predicts the opposite direction; they are kept only so that sd-scripts' command lines train the same.)"""
        kind = self.options.model_prediction_type
        if kind == "raw":
            return model_output
        x = noisy.to(model_output.dtype)
        if kind == "additive":
            return model_output - x
        s = self.sigma_of(timesteps).to(model_output).reshape(-1, *([1] * (model_output.ndim - 1)))
        return -s * model_output - x

    def sample_sigmas(self, batch_size: int, generator: Optional[torch.Generator] = None,
                      latent_shape=None) -> torch.Tensor:
        if self.options.timestep_sampling != "nextdit_shift":
            return super().sample_sigmas(batch_size, generator, latent_shape)
        if latent_shape is None:
            raise ValueError("nextdit_shift needs the latent shape to count image tokens")
        h, w = latent_shape[-2:]
        sigmas = rand((batch_size,), generator, "cpu").clamp(min=1e-7)
        return time_shift(flux_shift_mu((h // 2) * (w // 2)), sigmas)


class LuminaFamily(FluxAELatents, FlowDiTFamily):
    """Lumina Image 2.0 (Alpha-VLLM/Lumina-Image-2.0)."""

    name = "lumina"
    display_name = "Lumina"
    # what sd-scripts' LuminaNetworkTrainer.update_metadata records
    metadata_flow_keys = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling",
                          "sigmoid_scale", "model_prediction_type", "discrete_flow_shift")
    ignored_flags_note = ("attention backends of sd-scripts' own NextDiT; diffusers' model here uses PyTorch SDPA, so "
                          "they change nothing")
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 20
    single_file_markers = ("layers.0.attention.qkv.",
                           "model.diffusion_model.layers.0.attention.qkv.")
    contents = (("cap_embedder.", "a Lumina Image 2.0 DiT"),
                ("model.diffusion_model.cap_embedder.", "a Lumina Image 2.0 DiT"),
                ("model.layers.0.post_feedforward_layernorm.", "a Gemma-2 text encoder"))
    diffusers_class_markers = ()
    scripts = {"lora": "lumina_train_network.py", "finetune": "lumina_train.py"}
    text_encoder_labels = ("Text encoder (Gemma-2)",)
    denoiser_label = "DiT"
    component_file_flags = COMPONENT_FILE_FLAGS
    tiny_presets = ("tiny:lumina",)
    options_type = LuminaOptions
    lora_network_module = "networks.lora_lumina"  # what sd-scripts' lumina_train_network.py files say
    latent_cache_arch = "_lumina"
    block_classes = ("Lumina2TransformerBlock",)  # the repeated blocks FSDP wraps and --torch_compile compiles
    latent_cache_key_stride = 8
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = 8
    latents_scale = 1.0  # encode_images already applies the AE's shift and scale
    latents_shift = 0.0
    bucket_reso_multiple = 16  # sd-scripts: verify_bucket_reso_steps(16)
    supports_text_cache = True
    text_cache_suffix = "_lumina_te.npz"
    TEXT_KEYS = LLM_TEXT_KEYS  # also the keys of `_lumina_te.npz`

    # --- options -------------------------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.lumina.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.lumina.loading import write_lumina_preset

        check_folder_name(out, "Lumina is written as three files")
        return write_lumina_preset(preset, out)

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        return (f"--pretrained_model_name_or_path {written['dit']} --gemma2 {written['gemma2']} "
                f"--ae {written['ae']}")

    def check_model_files(self, path: str, options: LuminaOptions, vae: Optional[str],
                          blocks_to_swap: Optional[int]) -> None:
        check_model_source(path, options, vae)
        blocks = block_count(path) if blocks_to_swap else None
        if blocks:
            check_last_blocks_swap(blocks_to_swap, blocks)

    def text_cache_values(self, options: LuminaOptions) -> dict[str, Any]:
        return {"gemma2": options.gemma2, "gemma2_max_token_length": options.max_tokens,
                "system_prompt": options.system_prompt}

    # --- loading -------------------------------------------------------------------------------------
    def load_components(self, opts: LoadOptions, options: LuminaOptions) -> Components:
        """The preset tiny:lumina / random:lumina2, or an original DiT file with --gemma2 and --ae."""
        return load_lumina_components(opts, options)

    # --- text ----------------------------------------------------------------------------------------
    def tokenize_plain(self, components: Components, texts: list[str]) -> list[torch.Tensor]:
        """[ids, mask] of texts as they are (sd-scripts' negative prompts: no system prompt)."""
        tokenizer = components.tokenizers[0]
        out = tokenizer(texts, padding="max_length", truncation=True, max_length=self.options(components).max_tokens,
                        pad_to_multiple_of=8, return_tensors="pt")
        return [out.input_ids, out.attention_mask]

    def tokenize(self, components: Components, captions: list[str],
                 max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[Gemma ids, mask], (B, --gemma2_max_token_length rounded up to 8), the system prompt before each caption."""
        prefix = self.options(components).prompt_prefix()
        return self.tokenize_plain(components, [prefix + c for c in captions])

    def encode_text(self, components: Components, tokens: list[torch.Tensor],
                    clip_skip: Optional[int]) -> TextConditioning:
        """Gemma-2's second-to-last hidden states, the ids and the mask (as sd-scripts' strategy_lumina)."""
        return second_to_last_states(components.text_encoders[0], tokens)

    def check_loaded(self, components: Components, text: Any) -> None:
        if getattr(text, "clip_skip", None) is not None:
            raise ConfigError("--clip_skip: Lumina uses Gemma-2's second-to-last hidden states; drop --clip_skip")

    # --- denoising -----------------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> FlowMatchScheme:
        return LuminaFlowScheme(self.options(components).flow)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        """The velocity ε - x0: the DiT at t = 1 - σ, negated (NextDiT predicts x0 - ε)."""
        model = components.denoiser
        device, dtype = noisy_latents.device, noisy_latents.dtype
        t = text.tensors
        out = model(hidden_states=noisy_latents, timestep=(1 - timesteps.float() / 1000).to(device, dtype),
                    encoder_hidden_states=t["hidden_state"].to(device, dtype),
                    encoder_attention_mask=t["attention_mask"].to(device).bool(), return_dict=False)[0]
        return -out

    # --- generation ----------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        if components.vae is None:
            raise ConfigError("--ae: required to decode Lumina images (the FLUX.1 ae.safetensors)")
        return generate_lumina(self, components, requests, device or components.denoiser.device)

    # --- LoRA ----------------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet: every joint / refiner block and the final layer under NextDiT's names (q, k, v as one fused
        `attention_qkv`), the embedders with `embedder_dims`; lora_te: Gemma-2's attention and MLP (sd-scripts'
        networks/lora_lumina.py)."""
        args = LuminaNetworkArgs()  # sd-scripts' lora_lumina network args (lumina/network_args.py)
        targets = [LoraTarget("lora_unet", components.denoiser, TRANSFORMER_TARGETS, rename=layout.original_path,
                              fused_slot=layout.fused_slot, external_prefix="lycoris", network_args=args),
                   *embedder_targets(components.denoiser, args)]
        if components.text_encoders and components.text_encoders[0] is not None:
            targets.append(LoraTarget("lora_te", components.text_encoders[0], GEMMA2_TARGETS, is_text_encoder=True,
                                      network_args=args))
        return targets

    # --- saving --------------------------------------------------------------------------------------
    # As sd-scripts' lumina_train.py: one .safetensors DiT file in NextDiT names (Gemma-2 and the AE unchanged).
    save_formats = ("safetensors",)

    def single_file_state_dict(self, components: Components) -> dict:
        return layout.to_original(components.denoiser.state_dict())

    # --- memory --------------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        """The last N joint blocks (`layers`); at most blocks - 2, as sd-scripts' NextDiT allows."""
        return last_blocks(list(components.denoiser.layers), num_swap)

    # --- metadata ------------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        return "lumina2"  # sd-scripts' lumina_util.MODEL_VERSION_LUMINA_V2

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "lumina-2"  # sd-scripts' sai_model_spec.ARCH_LUMINA_2

    def modelspec_implementation(self) -> str:
        return LUMINA_IMPLEMENTATION

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return "epsilon"  # sd-scripts names none only for FLUX.1

