"""The Anima family: the Cosmos-Predict2 DiT with an LLM adapter over Qwen3-0.6B, the Qwen-Image VAE, rectified flow.

Text as sd-scripts: Qwen3's last hidden states (padding zeroed, --qwen3_max_token_length tokens)
with their mask, plus T5 token ids and mask (--t5_max_token_length) that the LLM adapter embeds and
cross-attends from; the adapter is part of the denoiser (AnimaDiT), so caches hold what sd-scripts'
`_anima_te.npz` files hold. Latents are the VAE's posterior mode normalised by its per-channel mean
and std (B, 16, H/8, W/8), as sd-scripts' `_anima.npz` caches. The model takes σ in [0, 1] and
predicts the velocity ε - x0.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from library.core.errors import ConfigError
from library.families.anima import layout
from library.families.anima.configs import LATENT_CHANNELS
from library.families.anima.generate import generate_anima
from library.families.anima.loading import (
    block_count,
    check_model_source,
    load_anima_components,
)
from library.families.anima.network_args import AnimaNetworkArgs
from library.families.anima.options import COMPONENT_FILE_FLAGS, LR_GROUPS, AnimaOptions
from library.families.base import (
    Components,
    LoadOptions,
    TextConditioning,
    check_folder_name,
)
from library.families.common.flow_dit import FlowDiTFamily
from library.families.common.swap_rules import check_last_blocks_swap, last_blocks
from library.objectives.flow import (
    FlowMatchScheme,
    loss_weighting,
)
from networks.lora_targets import LoraTarget, iter_target_paths, kohya_module_name

logger = logging.getLogger(__name__)

ANIMA_IMPLEMENTATION = "https://huggingface.co/circlestone-labs/Anima"
# sd-scripts' LoRA targets (networks/lora_anima.py) by the diffusers classes that hold the same layers:
# Block -> CosmosTransformerBlock, PatchEmbed -> CosmosPatchEmbed, TimestepEmbedding -> CosmosTimestepEmbedding,
# FinalLayer -> norm_out (CosmosAdaLayerNorm) + proj_out; the adapter's LLMAdapterTransformerBlock ->
# AnimaTextConditionerBlock; Qwen3's attention and MLP.
DIT_TARGETS = ("CosmosTransformerBlock", "CosmosPatchEmbed", "CosmosTimestepEmbedding", "CosmosAdaLayerNorm")
ADAPTER_TARGETS = ("AnimaTextConditionerBlock",)
QWEN3_TARGETS = ("Qwen3Attention", "Qwen3MLP")


class AnimaFlowScheme(FlowMatchScheme):
    """FLUX.1's rectified flow, but --weighting_scheme sigma_sqrt / cosmap weights the loss whatever the prediction
    type, as sd-scripts' anima_train_network.py does (compute_loss_weighting_for_anima on the raw velocity)."""

    def loss_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        return loss_weighting(self.options.weighting_scheme, self.sigma_of(timesteps))


class AnimaFamily(FlowDiTFamily):
    """Anima (circlestone-labs/Anima) and other Cosmos-Predict2 DiTs with the LLM adapter."""

    name = "anima"
    display_name = "Anima"
    # what sd-scripts' AnimaNetworkTrainer.update_metadata records
    metadata_flow_keys = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling",
                          "sigmoid_scale", "discrete_flow_shift")
    ignored_flags_note = ("memory options of sd-scripts' own Anima code; diffusers' models here use PyTorch SDPA and "
                          "encode whole images, so they change nothing")
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 30
    single_file_markers = ("net.blocks.0.self_attn.",
                           "model.diffusion_model.net.blocks.0.self_attn.")
    contents = (("net.blocks.", "an Anima DiT"),
                ("model.layers.", "a Qwen3 text encoder"))
    diffusers_class_markers = ()
    scripts = {"lora": "anima_train_network.py", "finetune": "anima_train.py"}
    text_encoder_labels = ("Text encoder (Qwen3)",)
    denoiser_label = "DiT"
    component_file_flags = COMPONENT_FILE_FLAGS
    flag_aliases = (("unsloth_offload_checkpointing", "cpu_offload_checkpointing"),)
    tiny_presets = ("tiny:anima",)
    options_type = AnimaOptions
    lora_network_module = "networks.lora_anima"  # what sd-scripts' anima_train_network.py files say
    latent_cache_arch = "_anima"
    block_classes = ("CosmosTransformerBlock",)  # the repeated blocks FSDP wraps and --torch_compile compiles
    latent_cache_key_stride = 8
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = 8
    latents_scale = 1.0  # encode_images already normalises (what sd-scripts' caches hold)
    latents_shift = 0.0
    bucket_reso_multiple = 16  # VAE 8x down and the 2x2 patches, as sd-scripts checks
    supports_text_cache = True
    text_cache_suffix = "_anima_te.npz"
    TEXT_KEYS = ("prompt_embeds", "attn_mask", "t5_input_ids", "t5_attn_mask")  # also the keys of `_anima_te.npz`
    # LyCORIS presets name sd-scripts' own Anima classes; these diffusers classes hold the same layers
    # (FinalLayer's AdaLN part: its linear is proj_out, a bare Linear no preset class reaches).
    lycoris_module_aliases = (("Block", "CosmosTransformerBlock"), ("PatchEmbed", "CosmosPatchEmbed"),
                              ("TimestepEmbedding", "CosmosTimestepEmbedding"), ("FinalLayer", "CosmosAdaLayerNorm"),
                              ("LLMAdapterTransformerBlock", "AnimaTextConditionerBlock"))

    # --- options -------------------------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.anima.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.anima.loading import write_anima_preset

        check_folder_name(out, "Anima is written as three files")
        return write_anima_preset(preset, out)

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        return (f"--pretrained_model_name_or_path {written['dit']} --qwen3 {written['qwen3']} "
                f"--vae {written['vae']}")

    def check_model_files(self, path: str, options: AnimaOptions, vae: Optional[str],
                          blocks_to_swap: Optional[int]) -> None:
        check_model_source(path, options, vae)
        blocks = block_count(path) if blocks_to_swap else None
        if blocks:
            check_last_blocks_swap(blocks_to_swap, blocks)

    def text_cache_values(self, options: AnimaOptions) -> dict[str, Any]:
        return {"qwen3": options.qwen3, "t5_tokenizer_path": options.t5_tokenizer_path,
                "qwen3_max_token_length": options.qwen3_max_token_length,
                "t5_max_token_length": options.t5_max_token_length}

    # --- loading -------------------------------------------------------------------------------------
    def load_components(self, opts: LoadOptions, options: AnimaOptions) -> Components:
        """The preset tiny:anima / random:anima, or an original DiT file with --qwen3 and --vae."""
        return load_anima_components(opts, options)

    # --- text ----------------------------------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str],
                 max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[Qwen3 ids, Qwen3 mask, T5 ids, T5 mask], each (B, its --*_max_token_length), padded to length."""
        options = self.options(components)
        qwen, t5 = components.tokenizers
        q = qwen(captions, padding="max_length", truncation=True, max_length=options.qwen3_max_token_length,
                 return_tensors="pt")
        t = t5(captions, padding="max_length", truncation=True, max_length=options.t5_max_token_length,
               return_tensors="pt")
        return [q.input_ids, q.attention_mask, t.input_ids, t.attention_mask]

    def encode_text(self, components: Components, tokens: list[torch.Tensor],
                    clip_skip: Optional[int]) -> TextConditioning:
        """Qwen3's last hidden states (zero at padding) and its mask; the T5 ids and mask pass through."""
        encoder = components.text_encoders[0]
        ids, mask, t5_ids, t5_mask = tokens
        mask = mask.to(encoder.device)
        states = encoder(input_ids=ids.to(encoder.device), attention_mask=mask).last_hidden_state
        states = states * mask.unsqueeze(-1).to(states.dtype)
        return TextConditioning(dict(zip(self.TEXT_KEYS, (states, mask, t5_ids.to(encoder.device),
                                                            t5_mask.to(encoder.device)))))

    def check_loaded(self, components: Components, text: Any) -> None:
        if getattr(text, "clip_skip", None) is not None:
            raise ConfigError("--clip_skip: Anima uses Qwen3's last hidden states; drop --clip_skip")

    # --- images --------------------------------------------------------------------------------------
    @staticmethod
    def _stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(vae.config.latents_mean, device=like.device, dtype=like.dtype).view(1, -1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=like.device, dtype=like.dtype).view(1, -1, 1, 1)
        return mean, std

    @torch.no_grad()
    def encode_images(self, vae, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Images in [-1, 1] -> (posterior mode - mean) / std, float32 (B, 16, H/8, W/8); no draw, as sd-scripts."""
        latents = vae.encode(images.to(vae.device, vae.dtype).unsqueeze(2)).latent_dist.mode()[:, :, 0].float()
        mean, std = self._stats(vae, latents)
        return (latents - mean) / std

    def denormalize_latents(self, vae, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(vae, latents)
        return latents * std + mean

    # --- denoising -----------------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> FlowMatchScheme:
        return AnimaFlowScheme(self.options(components).flow)

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        dit = components.denoiser
        device, dtype = noisy_latents.device, noisy_latents.dtype
        t = text.tensors
        return dit(noisy_latents, (timesteps.float() / 1000).to(device), t["prompt_embeds"].to(device, dtype),
                   t["attn_mask"].to(device), t["t5_input_ids"].to(device), t["t5_attn_mask"].to(device))

    # --- generation ----------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        if components.vae is None:
            raise ConfigError("--vae: required to decode Anima images (qwen_image_vae.safetensors)")
        return generate_anima(self, components, requests, device or components.denoiser.device)

    # --- LoRA ----------------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet: the DiT's blocks, patch / time embedders and final layer under their original names (the
        last three excluded by default, as sd-scripts), the adapter's blocks with train_llm_adapter=True;
        lora_te: Qwen3's attention and MLP. All carry Anima's network args (anima/network_args.py)."""
        dit = components.denoiser
        encoder = components.text_encoders[0] if components.text_encoders else None
        # Rooted at the whole AnimaDiT, so an external network's raw module paths (lycoris.kohya) map too.
        targets = [
            LoraTarget("lora_unet", dit, DIT_TARGETS, rename=layout.original_path),
            LoraTarget("lora_unet", dit.transformer.proj_out, ("Linear",),
                       rename=lambda _p: layout.original_path("transformer.proj_out")),
            LoraTarget("lora_unet", dit, ADAPTER_TARGETS, rename=layout.original_path,
                       enabled_by="train_llm_adapter"),
        ]
        if encoder is not None:
            targets.append(LoraTarget("lora_te", encoder, QWEN3_TARGETS, is_text_encoder=True))
        paths = {}
        for target in targets:
            for path, _ in iter_target_paths(target, False):
                paths[kohya_module_name(target, path)] = target.rename(path) if target.rename else path
        args = AnimaNetworkArgs(paths)
        for target in targets:
            target.network_args = args
        return targets

    # --- full fine-tune ------------------------------------------------------------------------------
    def denoiser_parameter_groups(self, components: Components, lr: float) -> list[tuple[str, list, float]]:
        """anima_train.py's groups: base, self_attn, cross_attn, mlp, mod (AdaLN) and llm_adapter, each at its
        --<group>_lr (default --learning_rate; 0 freezes the group), split by the original names as sd-scripts."""
        options = self.options(components)
        groups: dict[str, list] = {name: [] for name in ("base", *LR_GROUPS)}
        for path, param in components.denoiser.named_parameters():
            name = layout.original_path(path)
            kind = "llm_adapter" if name.startswith(layout.ADAPTER_PREFIX) else \
                next((g for g, part in (("self_attn", ".self_attn"), ("cross_attn", ".cross_attn"), ("mlp", ".mlp"),
                                        ("mod", ".adaln_modulation")) if part in name), "base")
            groups[kind].append(param)
        out = []
        for kind, params in groups.items():
            rate = lr if kind == "base" or getattr(options, f"{kind}_lr") is None else getattr(options, f"{kind}_lr")
            out.append((kind, params, rate))
        return out

    # --- saving --------------------------------------------------------------------------------------
    # As sd-scripts' anima_train.py: one .safetensors DiT file with the adapter (Qwen3 and the VAE unchanged).
    save_formats = ("safetensors",)

    def single_file_state_dict(self, components: Components) -> dict:
        return layout.original_tensors(components.denoiser)

    def save_model(self, components: Components, path: str, fmt: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict[str, str]] = None, mem_eff: bool = False, *, epoch: int = 0,
                   global_step: int = 0) -> str:
        """The DiT file, with `format: pt` in its header as the official file and sd-scripts' saves have."""
        return super().save_model(components, path, fmt, dtype, {"format": "pt", **(metadata or {})}, mem_eff,
                                  epoch=epoch, global_step=global_step)

    # --- metadata ------------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        return "anima"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "anima-preview"

    def modelspec_implementation(self) -> str:
        return ANIMA_IMPLEMENTATION

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return "epsilon"  # what sd-scripts writes for Anima (it names none only for FLUX.1)

    # --- memory --------------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        """The last N DiT blocks; at most blocks - 2, as sd-scripts allows."""
        return last_blocks(list(components.denoiser.transformer.transformer_blocks), num_swap)

