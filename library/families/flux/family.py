"""The FLUX.1 family: rectified-flow DiT with CLIP-L (pooled) and T5-XXL text, BFL-named LoRA keys.

Text conditioning as sd-scripts: CLIP-L's pooled output (77 tokens, no chunking)
and T5's last hidden states (--t5xxl_max_token_length tokens, optionally masked).
Latents (B, 16, h, w) are packed into 2x2 patches, (B, h/2 · w/2, 64), with
position ids (0, row, col) per patch and zeros for the text tokens; the
transformer's output is unpacked back, so the loop, noise and loss work on
ordinary latent tensors.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from library.core.errors import ConfigError, warn_once
from library.families.base import Components, LoadOptions, ModelFamily, TextConditioning
from library.families.common.autoencoder import (
    AE_SCALING_FACTOR,
    AE_SHIFT_FACTOR,
    LATENT_CHANNELS,
)
from library.families.common.clip_text import (
    TEXT_ENCODER_TARGETS,
    text_encoder_kohya_path,
)
from library.families.common.t5 import T5_TARGETS
from library.families.common.controlnet import save_controlnet_files
from library.families.flux import saving as flux_saving
from library.families.flux.controlnet import create_flux_controlnet, flux_control_kwargs
from library.families.flux.generate import generate_flux
from library.families.flux.loading import (
    block_counts,
    check_model_source,
    load_flux_components,
)
from library.families.flux.lora_names import (
    TRANSFORMER_TARGETS,
    bfl_module_path,
    fused_slot,
)
from library.families.flux.network_args import FluxNetworkArgs, in_layer_targets
from library.families.flux.options import COMPONENT_FILE_FLAGS, FluxOptions
from library.objectives.flow import (
    FlowMatchScheme,
    check_flow_compatible,
    check_no_ddpm_schedule,
)
from networks.lora_targets import LoraTarget

logger = logging.getLogger(__name__)

BFL_IMPLEMENTATION = "https://github.com/black-forest-labs/flux"
TEXT_KEYS = ("l_pooled", "t5_out", "txt_ids", "t5_attn_mask")  # also the keys of `*_flux_te.npz`
CLIP_TOKENS = 77


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 · w/2, 4C): 2x2 patches, row-major, channels then the patch's (dy, dx)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of pack_latents for latents of size (height, width)."""
    b, _, d = packed.shape
    c = d // 4
    x = packed.reshape(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def image_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(h/2 · w/2, 3) position ids of the packed patches: (0, row, col)."""
    ids = torch.zeros(height // 2, width // 2, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(height // 2, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(width // 2, device=device, dtype=dtype)[None, :]
    return ids.reshape(-1, 3)


def kontext_tokens(latents: torch.Tensor, controls: list) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.1 Kontext's sequence: the packed target latents, then each control image's packed latents with its own
    position ids (first id 1 for the first control, as FluxKontextPipeline; 2, 3, ... for more); (tokens, ids).
    Without controls: plain FLUX.1's tokens and ids."""
    b, _, h, w = latents.shape
    dtype, device = latents.dtype, latents.device
    tokens, ids = [pack_latents(latents)], [image_ids(h, w, device, dtype)]
    for i, control in enumerate(controls):
        control = control.to(device, dtype)
        ch, cw = control.shape[-2:]
        tokens.append(pack_latents(control))
        control_ids = image_ids(ch, cw, device, dtype)
        control_ids[:, 0] = i + 1
        ids.append(control_ids)
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=0)


def swap_split(num_swap: int, double: int, single: int) -> tuple[int, int]:
    """(double, single) blocks that --blocks_to_swap N swaps: N//2 and 2·(N − N//2), as sd-scripts;
    a one-line ConfigError when the model has fewer."""
    fits = [n for n in range(1, 2 * (double + single) + 1) if n // 2 <= double and 2 * (n - n // 2) <= single]
    if num_swap not in fits:
        limit = f"1..{fits[-1]}" if fits else "nothing"
        raise ConfigError(f"--blocks_to_swap {num_swap}: expected {limit} for this model ({double} double "
                          f"and {single} single blocks; N swaps N//2 double and 2*(N-N//2) single ones)")
    return num_swap // 2, 2 * (num_swap - num_swap // 2)


def optimizer_block(parameter_path: str) -> str:
    """`double_blocks.<i>` / `single_blocks.<i>` for a FluxTransformer2DModel parameter inside a block, else `other`."""
    head, _, rest = parameter_path.partition(".")
    index = rest.partition(".")[0]
    if head in ("transformer_blocks", "single_transformer_blocks") and index.isdigit():
        return f"{'double' if head == 'transformer_blocks' else 'single'}_blocks.{index}"
    return "other"


class FluxFamily(ModelFamily):
    """FLUX.1 dev / schnell (diffusers FluxTransformer2DModel), trained with rectified flow."""

    options_type = FluxOptions
    supports_text_cache = True
    text_encoder_outputs = (("l_pooled",), ("t5_out", "txt_ids", "t5_attn_mask"))
    # LyCORIS presets name the BFL block classes of sd-scripts' own Flux model; diffusers' blocks hold
    # the same layers (q/k/v separate), so a preset's targets are extended by these classes.
    lycoris_module_aliases = (("DoubleStreamBlock", "FluxTransformerBlock"),
                              ("SingleStreamBlock", "FluxSingleTransformerBlock"))

    name = "flux"
    # Which single files are this family's: key prefixes only its checkpoints carry (library/families/detect.py);
    # families are tried in detect_rank order, lowest first (the most specific markers first).
    detect_rank = 60
    single_file_markers = ("double_blocks.",
                           "model.diffusion_model.double_blocks.")
    contents = (("double_blocks.", "a FLUX.1 transformer"),
                ("model.diffusion_model.double_blocks.", "a FLUX.1 transformer"))
    diffusers_class_markers = ("Flux",)
    scripts = {"lora": "flux_train_network.py", "finetune": "flux_train.py", "controlnet": "flux_train_control_net.py"}
    model_types = (None, "flux", "kontext")  # the --model_type values of its scripts that select it
    controlnet_block_flags = True  # FluxControlNetModel copies the first double / single blocks
    selector_flag = "flux"
    text_encoder_labels = ("Text encoder 1 (CLIP-L)", "Text encoder 2 (T5-XXL)")
    denoiser_label = "Transformer"
    component_file_flags = COMPONENT_FILE_FLAGS
    tiny_presets = ("tiny:flux", "tiny:flux_kontext")
    lora_network_module = "networks.lora_flux"  # what sd-scripts' flux_train_network.py files say
    latent_cache_arch = "_flux"
    block_classes = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    context_parallel_token_pixels = 16  # diffusers' FluxTransformer2DModel._cp_plan; 512 (or 256) T5 tokens
    tensor_parallel = True  # diffusers' FluxTransformer2DModel._tp_plan
    latent_cache_key_stride = 8  # `latents_<h>x<w>` keys, one file per image for every resolution
    # gen_img's img2img / inpainting / highres fix (library/sampling/img2img.py); no regional prompts
    image_inputs = ("img2img", "inpaint", "highres")
    default_image_size = 512  # a request's size when neither prompt nor flag sets one
    latent_channels = LATENT_CHANNELS
    vae_scale_factor = 8
    # encode_images already returns the AE-normalised latents (what sd-scripts' `_flux.npz` caches hold),
    # so nothing is applied at train time; the AE's own factors are ae_scale / ae_shift.
    latents_scale = 1.0
    latents_shift = 0.0
    ae_scale = AE_SCALING_FACTOR
    ae_shift = AE_SHIFT_FACTOR
    bucket_reso_multiple = 32  # as sd-scripts (the 2x2 packing alone needs 16)
    text_cache_suffix = "_flux_te.npz"

    # --- options ---------------------------------------------------------------------
    @classmethod
    def presets(cls) -> dict:
        from library.families.flux.configs import PRESETS

        return PRESETS

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        from library.families.flux.saving import write_flux_preset

        written = write_flux_preset(preset, out, single_file=single_file)
        return written if single_file else {preset: out}

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        if "transformer" not in written:
            return ""
        return ("--pretrained_model_name_or_path " + written["transformer"]
                + "".join(f" --{flag} {written[flag]}" for flag in ("clip_l", "t5xxl", "ae")))

    def check_options(self, options: FluxOptions, model: LoadOptions, *, blocks_to_swap: Optional[int] = None,
                      min_timestep: Optional[int] = None, max_timestep: Optional[int] = None,
                      zero_terminal_snr: bool = False) -> None:
        """DDPM-only flags, a missing --clip_l / --t5xxl / --ae or too many blocks to swap: named now, before the
        data scan (block counts come from the preset, config.json or the file header; no weights are read)."""
        check_flow_compatible(min_timestep, max_timestep, zero_terminal_snr)
        check_no_ddpm_schedule(model.v_parameterization, model.noise_schedule, "FLUX.1", "--timestep_sampling and --discrete_flow_shift")
        path = model.pretrained_model_name_or_path
        if path:
            check_model_source(path, options)
            counts = block_counts(path) if blocks_to_swap else None
            if counts:
                swap_split(blocks_to_swap, *counts)

    control_hint = "FLUX.1 takes control images with --model_type kontext"

    def max_control_images(self, options: Optional[FluxOptions]) -> int:
        """FLUX.1 Kontext: 1, as FluxKontextPipeline takes (kontext_tokens would number more 2, 3, ...)."""
        return 1 if options is not None and options.model_type == "kontext" else 0

    def latent_cache_values(self, options: FluxOptions) -> dict[str, Any]:
        return {"ae": options.ae}

    def text_cache_values(self, options: FluxOptions) -> dict[str, Any]:
        return {"clip_l": options.clip_l, "t5xxl": options.t5xxl,
                "t5xxl_max_token_length": options.t5xxl_max_token_length,
                "apply_t5_attn_mask": options.apply_t5_attn_mask}

    def metadata_values(self, options: FluxOptions) -> dict[str, Any]:
        flow = options.flow
        return {"model_type": options.model_type,  # sd-scripts' ss_model_type: flux or chroma
                "timestep_sampling": flow.timestep_sampling, "sigmoid_scale": flow.sigmoid_scale,
                "discrete_flow_shift": flow.discrete_flow_shift, "weighting_scheme": flow.weighting_scheme,
                "logit_mean": flow.logit_mean, "logit_std": flow.logit_std, "mode_scale": flow.mode_scale,
                "model_prediction_type": flow.model_prediction_type, "guidance_scale": options.guidance_scale,
                "t5xxl_max_token_length": options.t5xxl_max_token_length,
                "apply_t5_attn_mask": options.apply_t5_attn_mask}

    def variant(self, options: FluxOptions) -> ModelFamily:
        """--model_type chroma: the Chroma family (library/families/chroma/family.py) trains instead."""
        if options.model_type == "chroma":
            from library.families import get_family

            return get_family("chroma")
        return self

    # --- loading ---------------------------------------------------------------------
    def load(self, opts: LoadOptions) -> Components:
        """A preset (tiny:flux, random:flux-dev, random:flux-schnell), a FLUX.1 diffusers folder, or a BFL
        single-file transformer with --clip_l / --t5xxl / --ae (which otherwise replace those parts)."""
        options = opts.family_options if opts.family_options is not None else FluxOptions()
        components = load_flux_components(opts, options)
        components.options = options
        return components

    # --- text --------------------------------------------------------------------------
    def t5_token_length(self, components: Components) -> int:
        """--t5xxl_max_token_length, or sd-scripts' default: 512 for dev (guidance) and 256 for schnell."""
        length = self.options(components).t5xxl_max_token_length
        if length:
            return length
        return 512 if components.denoiser.config.guidance_embeds else 256

    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        """[CLIP ids (B, 77), T5 ids (B, L), T5 attention mask (B, L)]."""
        if max_token_length not in (None, 75):
            warn_once(logger, "--max_token_length is ignored for FLUX.1: CLIP-L reads 77 tokens; "
                              "use --t5xxl_max_token_length for T5")
        clip_tok, t5_tok = components.tokenizers
        clip = clip_tok(captions, padding="max_length", truncation=True, max_length=CLIP_TOKENS,
                        return_tensors="pt").input_ids
        t5 = t5_tok(captions, padding="max_length", truncation=True, max_length=self.t5_token_length(components),
                    return_tensors="pt")
        return [clip, t5.input_ids, t5.attention_mask]

    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        return self.encode_text_with(components, tokens, clip_skip, frozenset((0, 1)))

    def encode_text_with(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int],
                         encoders: frozenset[int]) -> TextConditioning:
        """CLIP-L's pooled output (encoder 0) and/or T5's states, ids and mask (encoder 1)."""
        clip, t5 = components.text_encoders
        clip_ids, t5_ids, t5_mask = tokens
        out: dict[str, torch.Tensor] = {}
        if 0 in encoders:
            out["l_pooled"] = clip(clip_ids.to(clip.device), return_dict=True).pooler_output
        if 1 in encoders:
            mask = t5_mask.to(t5.device)
            t5_out = t5(t5_ids.to(t5.device), attention_mask=mask if self.options(components).apply_t5_attn_mask else None,
                        return_dict=True).last_hidden_state
            out["t5_out"] = t5_out
            out["txt_ids"] = torch.zeros(t5_out.shape[0], t5_out.shape[1], 3, device=t5_out.device, dtype=t5_out.dtype)
            out["t5_attn_mask"] = mask
        return TextConditioning(tensors=out)

    # --- images ---------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Images in [-1, 1] -> AE-normalised latents (x - shift) · scale, float32 (B, 16, H/8, W/8)."""
        latents = super().encode_images(vae, images, generator)
        config = getattr(vae, "config", None)
        scale = getattr(config, "scaling_factor", None) or self.ae_scale
        shift = getattr(config, "shift_factor", None)
        return (latents - (self.ae_shift if shift is None else shift)) * scale

    # --- denoising -------------------------------------------------------------------------
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> FlowMatchScheme:
        return FlowMatchScheme(self.options(components).flow)

    def context_parallel_refusal(self, options: FluxOptions) -> Optional[str]:
        # measured: a 4-step LoRA 2.3e-2 away from one process's with the mask (2e-7 without)
        if options.apply_t5_attn_mask:
            return "--apply_t5_attn_mask (diffusers' token split does not carry the attention mask)"
        return None

    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        model = components.denoiser
        options = self.options(components)
        t = text.tensors
        dtype, device = noisy_latents.dtype, noisy_latents.device
        b, _, h, w = noisy_latents.shape
        t5_out = t["t5_out"].to(device, dtype)
        guidance = None
        if model.config.guidance_embeds:
            # batch["guidance"] (B,): a per-call value (generation's --g); else --guidance_scale
            given = batch.get("guidance")
            guidance = given.to(device, dtype) if given is not None else \
                torch.full((b,), options.guidance_scale, device=device, dtype=dtype)
        tokens, ids = kontext_tokens(noisy_latents, batch.get("scaled_control_latents") or [])
        kwargs = None
        if options.apply_t5_attn_mask:
            # One boolean mask over the joint [text, image] sequence; image tokens always attend.
            mask = torch.cat([t["t5_attn_mask"].to(device).bool(),
                              torch.ones(b, tokens.shape[1], dtype=torch.bool, device=device)], dim=1)
            kwargs = {"attention_mask": mask[:, None, None, :]}
        inputs = dict(hidden_states=tokens, encoder_hidden_states=t5_out,
                      pooled_projections=t["l_pooled"].to(device, dtype),
                      timestep=(timesteps.float() / 1000).to(device, dtype),
                      img_ids=ids, txt_ids=t["txt_ids"][0].to(device, dtype),
                      guidance=guidance, joint_attention_kwargs=kwargs)
        control = flux_control_kwargs(self, components, noisy_latents, inputs, batch, pack_latents)
        out = model(**inputs, **control, return_dict=False)[0]
        return unpack_latents(out[:, :(h // 2) * (w // 2)], h, w)  # the loss sees the target's tokens only

    def create_controlnet(self, components: Components, path: Optional[str], num_double_blocks=None,
                          num_single_blocks=None):
        return create_flux_controlnet(components.denoiser, path, num_double_blocks, num_single_blocks)

    def save_controlnet(self, controlnet, path, fmt, dtype, metadata):
        return save_controlnet_files(controlnet, path, fmt, dtype, metadata)

    # --- generation -------------------------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        """Flow-match Euler generation (library/families/flux/generate.py); clip_skip does not apply."""
        return generate_flux(self, components, requests, device or components.denoiser.device)

    # --- LoRA ---------------------------------------------------------------------------------
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """lora_unet (BFL names, fused qkv / linear1), lora_te1 (CLIP-L) and the optional targets: the layers
        outside the blocks (`in_dims`) and T5 (`lora_te3`, `train_t5xxl=True`); all carry FLUX.1's network args
        (library/families/flux/network_args.py)."""
        from dataclasses import replace


        transformer = components.denoiser
        encoders = list(components.text_encoders) + [None] * (2 - len(components.text_encoders))
        args = FluxNetworkArgs.for_transformer(transformer)
        targets = [
            LoraTarget("lora_unet", transformer, TRANSFORMER_TARGETS, rename=bfl_module_path, fused_slot=fused_slot,
                       network_args=args, external_prefix="lycoris"),
            *in_layer_targets(transformer, args),
        ]
        if encoders[0] is not None:  # a caller that builds only the transformer (counting, conversion) has none
            targets.append(LoraTarget("lora_te1", encoders[0], TEXT_ENCODER_TARGETS, is_text_encoder=True,
                                      rename=text_encoder_kohya_path, network_args=args))
        if encoders[1] is not None:
            targets.append(replace(self.t5_lora_target(components), enabled_by="train_t5xxl", network_args=args))
        return targets

    def t5_lora_target(self, components: Components) -> LoraTarget:
        """The T5 target (`lora_te3_encoder_block_N_...`) on its own, always on; lora_targets has it behind
        sd-scripts' `train_t5xxl=True`."""
        return LoraTarget("lora_te3", components.text_encoders[1], T5_TARGETS, is_text_encoder=True)

    # --- saving -------------------------------------------------------------------------------------
    # As sd-scripts' flux_train.py, which writes only `.safetensors` (no `.ckpt`).
    save_formats = ("safetensors", "diffusers", "diffusers_safetensors")

    def single_file_state_dict(self, components: Components) -> dict:
        """The transformer alone in the BFL layout, as flux1-dev.safetensors and sd-scripts' flux_train.py save it
        (CLIP-L, T5 and the AE are not written; load it back with --clip_l / --t5xxl / --ae)."""
        return flux_saving.bfl_tensors(components.denoiser)

    def pipeline_folder(self, components: Components) -> tuple[dict, dict]:
        """A whole FluxPipeline folder (not a transformer-only one): it loads back with every part, no flag needed."""
        clip, t5 = components.text_encoders
        return flux_saving.pipeline_folder({"transformer": components.denoiser, "vae": components.vae,
                                            "text_encoder": clip, "text_encoder_2": t5,
                                            "tokenizer": components.tokenizers[0],
                                            "tokenizer_2": components.tokenizers[1]})

    # --- metadata -------------------------------------------------------------------------------
    def base_model_version(self, components: Components) -> str:
        return "flux1"

    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        return "flux-1-dev" if components.denoiser.config.guidance_embeds else "flux-1-schnell"

    def modelspec_implementation(self) -> str:
        return BFL_IMPLEMENTATION

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        return None  # sd-scripts writes no prediction type for FLUX.1

    def optimizer_block(self, parameter_path: str) -> Optional[str]:
        """sd-scripts' flux_train.py grouping: one block per double and per single block (BFL names), and one
        for everything else (embedders, final layer)."""
        return optimizer_block(parameter_path)

    # --- memory -----------------------------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list:
        """sd-scripts' rule: N swaps the last N//2 double and 2·(N − N//2) single blocks (a single block
        costs about half a double one), in forward order; N is bounded by the model's block counts."""
        model = components.denoiser
        double, single = list(model.transformer_blocks), list(model.single_transformer_blocks)
        n_double, n_single = swap_split(num_swap, len(double), len(single))
        return double[len(double) - n_double:] + single[len(single) - n_single:]
