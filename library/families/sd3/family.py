"""The SD3 / SD3.5 family: MMDiT (diffusers SD3Transformer2DModel) with CLIP-L, CLIP-G and T5-XXL text,
SAI-named LoRA keys with fused qkv, trained as sd-scripts' sd3_train_network.py trains it.

Text conditioning as sd-scripts: CLIP-L's and CLIP-G's penultimate hidden states (77 tokens each,
no chunking) side by side, zero-padded to T5's width, followed by T5's last hidden states
(--t5xxl_max_token_length tokens) along the sequence; the pooled input is CLIP-L's and CLIP-G's
projected pooled outputs side by side. --apply_lg_attn_mask / --apply_t5_attn_mask mask padding in
the text encoders only (the MMDiT attends to every token, as in sd-scripts). The per-encoder
dropout rates zero a caption's outputs of that encoder during training.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

import torch

from library.core.errors import ConfigError, warn_once
from library.families import model_saving
from library.families.base import Components, LoadOptions, ModelFamily, TextConditioning
from library.families.common.clip_text import (
    TEXT_ENCODER_TARGETS,
    text_encoder_kohya_path,
)
from library.families.common.swap_rules import check_last_blocks_swap, last_blocks
from library.families.common.t5 import T5_TARGETS
from library.families.sd3 import layout as sai
from library.families.sd3 import saving as sd3_saving
from library.families.sd3.configs import (
    LATENT_CHANNELS,
    VAE_SCALING_FACTOR,
    VAE_SHIFT_FACTOR,
    model_type_of,
)
from library.families.sd3.generate import generate_sd3
from library.families.sd3.loading import (
    block_count,
    load_sd3_components,
    missing_component_flags,
    sd3_source_kind,
)
from library.families.sd3.lora_names import (
    TRANSFORMER_TARGETS,
    fused_slot,
    sai_module_path,
)
from library.families.sd3.network_args import SD3NetworkArgs, emb_layer_targets
from library.families.sd3.options import COMPONENT_FILE_FLAGS, SD3Options
from library.families.sd3.pos_embed import install as install_positions
from library.families.sd3.pos_embed import latent_sizes_of
from library.objectives.flow import check_no_ddpm_schedule
from library.objectives.flow_sd3 import SD3FlowScheme
from networks.lora_targets import LoraTarget

logger = logging.getLogger(__name__)

CLIP_TOKENS = 77
# TextConditioning keys of each encoder (CLIP-L, CLIP-G, T5); also the arrays of `*_sd3_te.npz`.
ENCODER_KEYS = (("l_out", "l_pooled", "clip_l_attn_mask"), ("g_out", "g_pooled", "clip_g_attn_mask"),
                ("t5_out", "t5_attn_mask"))


def drop_rows(tensors: dict[str, torch.Tensor], keys: tuple[str, ...], dropped: torch.Tensor) -> None:
    """Zero the rows `dropped` (B,) bool of each tensor in `keys` (a caption's outputs of one encoder)."""
    for key in keys:
        t = tensors[key]
        tensors[key] = t * (~dropped.to(t.device)).reshape(-1, *([1] * (t.ndim - 1))).to(t.dtype)


class SD3Family(ModelFamily):
    """SD3 medium, SD3.5 medium and SD3.5 large (diffusers SD3Transformer2DModel), rectified flow as sd-scripts."""

    name = "sd3"
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 70
    single_file_markers = ("model.diffusion_model.joint_blocks.",
                                "joint_blocks.")
    contents = (("model.diffusion_model.joint_blocks.", "an SD3 checkpoint"),
                ("joint_blocks.", "an SD3 MMDiT"))
    diffusers_class_markers = ("StableDiffusion3",)
    scripts = {"lora": "sd3_train_network.py", "finetune": "sd3_train.py"}
    text_encoder_labels = ("Text encoder 1 (CLIP-L)", "Text encoder 2 (CLIP-G)")
    denoiser_label = "MMDiT"
    component_file_flags = COMPONENT_FILE_FLAGS
    tiny_presets = ("tiny:sd3",)
    options_type = SD3Options
    lora_network_module = "networks.lora_sd3"
    latent_cache_arch = "_sd3"
    latent_cache_key_stride = 8
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = 8
    # caches hold the VAE's raw latents, as sd-scripts' `_sd3.npz`; (x - shift) · scale is applied at train time
    latents_scale = VAE_SCALING_FACTOR
    latents_shift = VAE_SHIFT_FACTOR
    ae_scale = VAE_SCALING_FACTOR
    ae_shift = VAE_SHIFT_FACTOR
    bucket_reso_multiple = 32  # sd-scripts' verify_bucket_reso_steps(32)
    supports_text_cache = True
    text_cache_suffix = "_sd3_te.npz"
    text_encoder_outputs = ENCODER_KEYS
    lycoris_module_aliases = (("SingleDiTBlock", "JointTransformerBlock"),)
    block_classes = ("JointTransformerBlock",)  # the repeated blocks FSDP wraps and --torch_compile compiles
    fine_tune_text_encoders = 2  # sd3_train.py --train_text_encoder: CLIP-L and CLIP-G (T5 stays frozen) ...
    fine_tune_t5xxl_encoder = 2  # ... unless --train_t5xxl

    # --- options ---------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.sd3.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.sd3.saving import write_sd3_preset

        layout = "diffusers" if not single_file else "separate" if separate_text_encoders else "single_file"
        return write_sd3_preset(preset, out, layout)

    def denoiser_parameter_groups(self, components: Components, lr: float) -> Optional[list[tuple[str, list, float]]]:
        """sd3_train.py --num_last_block_to_freeze N: the last N joint blocks frozen (rate 0), the rest at `lr`."""
        n = self.options(components).num_last_block_to_freeze
        if not n:
            return None
        blocks = list(components.denoiser.transformer_blocks)
        frozen = {id(p) for block in blocks[max(0, len(blocks) - n):] for p in block.parameters()}
        params = list(components.denoiser.parameters())
        return [("base", [p for p in params if id(p) not in frozen], lr),
                (f"last {min(n, len(blocks))} blocks", [p for p in params if id(p) in frozen], 0.0)]

    def check_options(self, options: SD3Options, model: LoadOptions, *, blocks_to_swap: Optional[int] = None,
                      min_timestep: Optional[int] = None, max_timestep: Optional[int] = None,
                      zero_terminal_snr: bool = False) -> None:
        """DDPM-only flags, a missing --clip_l / --clip_g / --t5xxl or too many
        blocks to swap: named now, before the data scan (no weights are read)."""
        if zero_terminal_snr:
            raise ConfigError("--zero_terminal_snr: only for DDPM models; a flow-matching model already reaches "
                              "pure noise")
        check_no_ddpm_schedule(model.v_parameterization, model.noise_schedule, "SD3",
                               "--weighting_scheme and --training_shift")
        for flag, value in (("min_timestep", min_timestep), ("max_timestep", max_timestep)):
            if value is not None and not 0 <= value <= 1000:
                raise ConfigError(f"--{flag}: expected an integer from 0 to 1000, got {value}")
        if min_timestep is not None and max_timestep is not None and min_timestep >= max_timestep:
            raise ConfigError(f"--min_timestep {min_timestep}: expected less than --max_timestep {max_timestep}")
        path = model.pretrained_model_name_or_path
        if path:
            if sd3_source_kind(path) == "single_file":
                message = missing_component_flags(path, options)
                if message:
                    raise ConfigError(message)
            blocks = block_count(path) if blocks_to_swap else None
            if blocks:
                check_last_blocks_swap(blocks_to_swap, blocks, "joint blocks")

    def text_cache_values(self, options: SD3Options) -> dict[str, Any]:
        return {"clip_l": options.clip_l, "clip_g": options.clip_g, "t5xxl": options.t5xxl,
                "t5xxl_max_token_length": options.t5xxl_max_token_length,
                "apply_lg_attn_mask": options.apply_lg_attn_mask, "apply_t5_attn_mask": options.apply_t5_attn_mask}

    def metadata_values(self, options: SD3Options) -> dict[str, Any]:
        """What sd-scripts' Sd3NetworkTrainer.update_metadata records."""
        flow = options.flow
        return {"apply_lg_attn_mask": options.apply_lg_attn_mask, "apply_t5_attn_mask": options.apply_t5_attn_mask,
                "weighting_scheme": flow.weighting_scheme, "logit_mean": flow.logit_mean,
                "logit_std": flow.logit_std, "mode_scale": flow.mode_scale}

    def prepare_for_data(self, components: Components, resolutions: list[tuple[int, int]]) -> None:
        """--enable_scaled_pos_embed (a position grid per training resolution) and --pos_emb_random_crop_rate
        (library/families/sd3/pos_embed.py), as sd-scripts sets them up from the datasets' resolutions."""
        options = self.options(components)
        if options.enable_scaled_pos_embed or options.pos_emb_random_crop_rate:
            sizes = latent_sizes_of(resolutions) if options.enable_scaled_pos_embed else None
            if sizes is not None:
                logger.info("scaled position embeddings for latent sizes %s", sizes)
            install_positions(components.denoiser, sizes, options.pos_emb_random_crop_rate)

    # --- loading ---------------------------------------------------------------------
    def load(self, opts: LoadOptions) -> Components:
        """A preset (tiny:sd3, random:sd3-medium, random:sd3.5-medium, random:sd3.5-large), a diffusers folder,
        or a SAI single file; --clip_l / --clip_g / --t5xxl / --vae give or replace those parts."""
        options = opts.family_options if opts.family_options is not None else SD3Options()
        components = load_sd3_components(opts, options)
        components.options = options
        return components

    # --- text ------------------------------------------------------------------------
    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[CLIP-L ids, CLIP-G ids (B, 77), T5 ids (B, L), and their attention masks in the same order]."""
        if max_token_length not in (None, 75):
            warn_once(logger, "--max_token_length is ignored for SD3: CLIP-L and CLIP-G read 77 tokens; "
                              "use --t5xxl_max_token_length for T5")
        tok_l, tok_g, tok_t5 = components.tokenizers
        length = self.options(components).t5xxl_max_token_length
        out = [tok(captions, padding="max_length", truncation=True, max_length=n, return_tensors="pt")
               for tok, n in ((tok_l, CLIP_TOKENS), (tok_g, CLIP_TOKENS), (tok_t5, length))]
        return [o.input_ids for o in out] + [o.attention_mask for o in out]

    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        return self.encode_text_with(components, tokens, clip_skip, frozenset((0, 1, 2)))

    def encode_text_with(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int],
                         encoders: frozenset[int]) -> TextConditioning:
        """CLIP-L (0) / CLIP-G (1): penultimate states, projected pooled output and mask; T5 (2): states and mask."""
        options = self.options(components)
        out: dict[str, torch.Tensor] = {}
        for i in (0, 1):
            if i not in encoders:
                continue
            encoder, ids, mask = components.text_encoders[i], tokens[i], tokens[3 + i]
            mask = mask.to(encoder.device)
            result = encoder(ids.to(encoder.device), attention_mask=mask if options.apply_lg_attn_mask else None,
                             output_hidden_states=True, return_dict=True)
            states, pooled, mask_key = ENCODER_KEYS[i]
            out[states], out[pooled], out[mask_key] = result.hidden_states[-2], result.text_embeds, mask
        if 2 in encoders:
            t5, mask = components.text_encoders[2], tokens[5].to(components.text_encoders[2].device)
            out["t5_out"] = t5(tokens[2].to(t5.device), attention_mask=mask if options.apply_t5_attn_mask else None,
                               return_dict=True).last_hidden_state
            out["t5_attn_mask"] = mask
        return TextConditioning(tensors=out)

    def _dropped(self, options: SD3Options, batch: dict, batch_size: int) -> Optional[torch.Tensor]:
        """(B, 3) bool: which captions lose which encoder's outputs this step (from each sample's seed)."""
        rates = torch.tensor([options.clip_l_dropout_rate, options.clip_g_dropout_rate, options.t5_dropout_rate])
        if not rates.any() or not torch.is_grad_enabled():
            return None
        seeds = batch.get("noise_seeds")
        if seeds and len(seeds) == batch_size:
            draws = torch.stack([torch.rand(3, generator=torch.Generator().manual_seed(int(s) + 7919)) for s in seeds])
        else:
            draws = torch.rand(batch_size, 3)
        return draws < rates

    # --- denoising -------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> SD3FlowScheme:
        return SD3FlowScheme(self.options(components).flow)

    def context(self, components: Components, text: TextConditioning, batch: dict, device, dtype):
        """(encoder_hidden_states, pooled_projections) for the MMDiT, after this step's caption dropout."""
        t = dict(text.tensors)
        b = t["t5_out"].shape[0]
        dropped = self._dropped(self.options(components), batch, b)
        if dropped is not None:
            for i, keys in enumerate(ENCODER_KEYS):
                drop_rows(t, keys, dropped[:, i])
        lg = torch.cat([t["l_out"].to(device, dtype), t["g_out"].to(device, dtype)], dim=-1)
        t5 = t["t5_out"].to(device, dtype)
        lg = torch.nn.functional.pad(lg, (0, t5.shape[-1] - lg.shape[-1]))
        pooled = torch.cat([t["l_pooled"].to(device, dtype), t["g_pooled"].to(device, dtype)], dim=-1)
        return torch.cat([lg, t5], dim=-2), pooled

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        """The MMDiT's velocity for latents (B, 16, h, w) at timesteps σ·1000."""
        dtype, device = noisy_latents.dtype, noisy_latents.device
        context, pooled = self.context(components, text, batch, device, dtype)
        return components.denoiser(hidden_states=noisy_latents, encoder_hidden_states=context,
                                   pooled_projections=pooled, timestep=timesteps.to(device, dtype),
                                   return_dict=False)[0]

    # --- generation -------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        """Flow-match Euler generation with CFG (library/families/sd3/generate.py); clip_skip does not apply."""
        return generate_sd3(self, components, requests, device or components.denoiser.device)

    # --- LoRA ---------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet (SAI names, fused qkv), the layers outside the joint blocks (with `emb_dims`), lora_te1 (CLIP-L),
        lora_te2 (CLIP-G) and, with `train_t5xxl=True`, lora_te3 (T5); all carry SD3's network args
        (library/families/sd3/network_args.py)."""
        transformer = components.denoiser
        args = SD3NetworkArgs(int(transformer.config.num_layers))
        targets = [LoraTarget("lora_unet", transformer, TRANSFORMER_TARGETS, rename=sai_module_path,
                              fused_slot=fused_slot, network_args=args, external_prefix="lycoris"),
                   *emb_layer_targets(transformer, args)]
        encoders = list(components.text_encoders) + [None] * (3 - len(components.text_encoders))
        for prefix, encoder in (("lora_te1", encoders[0]), ("lora_te2", encoders[1])):
            if encoder is not None:
                targets.append(LoraTarget(prefix, encoder, TEXT_ENCODER_TARGETS, is_text_encoder=True,
                                          rename=text_encoder_kohya_path, network_args=args))
        if encoders[2] is not None:
            targets.append(replace(self.t5_lora_target(components), enabled_by="train_t5xxl", network_args=args))
        return targets

    def t5_lora_target(self, components: Components) -> LoraTarget:
        """The T5 target (`lora_te3_encoder_block_N_...`) on its own, always on."""
        return LoraTarget("lora_te3", components.text_encoders[2], T5_TARGETS, is_text_encoder=True)

    # --- saving -------------------------------------------------------------------------------------
    save_formats = ("safetensors", "diffusers", "diffusers_safetensors")  # sd-scripts' sd3_train.py: safetensors

    def save_model(self, components: Components, path: str, fmt: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict[str, str]] = None, mem_eff: bool = False, *, epoch: int = 0,
                   global_step: int = 0) -> str:
        """As the base class; a diffusers folder is written with the transformer in diffusers' own order."""
        if fmt in model_saving.FOLDER_FORMATS:
            with sai.diffusers_order(components.denoiser):
                return super().save_model(components, path, fmt, dtype, metadata, mem_eff, epoch=epoch,
                                          global_step=global_step)
        return super().save_model(components, path, fmt, dtype, metadata, mem_eff, epoch=epoch,
                                  global_step=global_step)

    def single_file_state_dict(self, components: Components) -> dict:
        """The SAI all-in-one layout: MMDiT, VAE and the three text encoders (loads back with no flag)."""
        return sd3_saving.single_file_tensors(self._parts(components))

    def pipeline_folder(self, components: Components) -> tuple[dict, dict]:
        return sd3_saving.pipeline_folder(self._parts(components))

    @staticmethod
    def _parts(components: Components) -> dict:
        clip_l, clip_g, t5 = components.text_encoders
        tl, tg, tt5 = components.tokenizers
        return {"transformer": components.denoiser, "vae": components.vae, "text_encoder": clip_l, "text_encoder_2": clip_g,
                "text_encoder_3": t5, "tokenizer": tl, "tokenizer_2": tg, "tokenizer_3": tt5}

    # --- metadata -------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        """sd-scripts' SD3 model_type: "medium", "5-medium" or "5-large"."""
        return model_type_of(components.denoiser.config)

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return f"stable-diffusion-3-{model_type_of(components.denoiser.config)}"

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return None

    # --- memory -----------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        """The last N joint blocks, N at most the block count - 2 (sd-scripts' bound)."""
        return last_blocks(list(components.denoiser.transformer_blocks), num_swap, "joint blocks")
