"""Load FLUX.2 (klein and dev) from the files users have, and write the tiny presets in the same layouts.

- a diffusers folder (black-forest-labs/FLUX.2-klein-4B and -9B, -base: model_index.json, transformer/, vae/,
  text_encoder/, tokenizer/), read by diffusers' and transformers' own from_pretrained;
- the DiT as one `.safetensors` in BFL's names (ComfyUI's flux-2-klein-4b.safetensors: `double_blocks.N.img_attn.qkv`,
  `single_blocks.N.linear1`, `img_in`, ...) or ComfyUI's whole-model file (`model.diffusion_model.*`), converted by
  diffusers' own single-file converter; with
- --qwen3: Qwen3 as one file (`model.*` keys as ComfyUI's qwen_3_4b.safetensors, or bare `layers.*`) or a
  transformers folder, and --ae: the FLUX.2 autoencoder (flux2-vae.safetensors: LDM names and the `bn.*` statistics);
- the Qwen tokenizer: the tiny one for the tiny encoder, else Qwen/Qwen3-4B from --tokenizer_cache_dir or the local
  HF cache (Qwen3-4B and -8B share it);
- FLUX.2 [dev]: the folder black-forest-labs/FLUX.2-dev (text_encoder/ a Mistral3ForConditionalGeneration, tokenizer/
  its processor), or its DiT file flux2-dev.safetensors (`guidance_in.*`) with --mistral3 (library/families/common/
  mistral3.py) and --ae. Which one a file is comes from the DiT (its guidance embedding) and the text encoder found.

Every single-file configuration is read from tensor shapes; models are built on the meta device and adopt the tensors.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from library.core.safetensors_io import write_safetensors
from library.families.base import Components, LoadOptions, ModelLoadError
from library.families.common.autoencoder import ae_file_tensors, load_ldm_ae_file
from library.families.common.mistral3 import language_model, load_mistral3
from library.families.common.qwen3 import load_qwen3
from library.families.common.loading import (adopt, classify_source, finish_components, load_dit_parts,
                                             load_folder_parts, part_config, read_dit_file)
from library.families.common.swap_rules import indexed_blocks_in_file
from library.families.flux2 import layout
from library.families.flux2.configs import (
    LATENT_CHANNELS,
    PATCHED_CHANNELS,
    MISTRAL_TEXT_LAYERS,
    PRESETS,
    QWEN3_TOKENIZER_REPO,
    TEXT_LAYERS,
    build_flux2_modules,
    build_mistral_tokenizer,
    build_qwen3_tokenizer,
    mistral_tokenizer_size,
    transformer_config,
    vae_config,
)
from library.families.common.diffusers_import import diffusers_class, diffusers_classes

_DIT_MARKER = re.compile(r"^(model\.diffusion_model\.)?double_blocks\.0\.img_attn\.qkv\.")
FOLDER_PARTS = ("transformer", "vae", "text_encoder", "tokenizer")
BN_KEYS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def flux2_source_kind(path: str) -> str:
    """"preset", "diffusers" or "single_file" (a ModelLoadError naming the problem otherwise)."""
    return classify_source(path, PRESETS, "FLUX.2", folder_parts=FOLDER_PARTS, file_suffixes=(".safetensors",),
                           expected="a FLUX.2 diffusers folder, a FLUX.2 DiT .safetensors file or the preset "
                                    "tiny:flux2 / tiny:flux2_dev")


def load_dit_file(path: str, dtype: torch.dtype, label: str = "--pretrained_model_name_or_path"):
    """Flux2Transformer2DModel from an original FLUX.2 file (or ComfyUI's whole-model file)."""
    Flux2Transformer2DModel = diffusers_class("Flux2Transformer2DModel")

    tensors, shape = read_dit_file(label, path, dtype, expected="a FLUX.2 DiT (double_blocks.*.img_attn.qkv keys)",
                                   marker=_DIT_MARKER, infer_shape=layout.infer_shape, what="FLUX.2 DiT")
    if shape["patch_in"] != PATCHED_CHANNELS:
        raise ModelLoadError(f"{label} {path}: expected a DiT on {LATENT_CHANNELS} latent channels in 2x2 patches "
                             f"({PATCHED_CHANNELS}), found img_in input {shape['patch_in']} (a FLUX.1 file?)")
    head_dim = shape["head_dim"]
    if head_dim % 8:
        raise ModelLoadError(f"{label} {path}: head width {head_dim} does not split into FLUX.2's four RoPE axes")
    inner = shape["heads"] * head_dim
    config = transformer_config(PRESETS["random:flux2"]) | dict(
        num_layers=shape["double_layers"], num_single_layers=shape["single_layers"], attention_head_dim=head_dim,
        num_attention_heads=shape["heads"], joint_attention_dim=shape["joint_attention_dim"],
        mlp_ratio=shape["mlp_hidden"] / inner, axes_dims_rope=(head_dim // 4,) * 4,
        guidance_embeds=shape["guidance_embeds"])
    return adopt(label, path, lambda: Flux2Transformer2DModel(**config), layout.to_diffusers(tensors))






def load_ae_file(path: str, dtype: torch.dtype = torch.float32):
    """AutoencoderKLFlux2 from the FLUX.2 AE file (LDM VAE keys without prefix, 32 latent channels, `bn.*`)."""
    AutoencoderKLFlux2 = diffusers_class("AutoencoderKLFlux2")

    return load_ldm_ae_file(
        path, dtype, AutoencoderKLFlux2, vae_config, latent_channels=LATENT_CHANNELS,
        expected="the FLUX.2 autoencoder (flux2-vae.safetensors: encoder.*, decoder.*, bn.*)",
        holds=lambda keys: "encoder.conv_in.weight" in keys and "bn.running_mean" in keys, what="FLUX.2",
        as_stored={"bn.running_mean": None, "bn.running_var": None, "bn.num_batches_tracked": torch.tensor(0)})


def flux2_ae_file_tensors(vae) -> dict[str, torch.Tensor]:
    """An AutoencoderKLFlux2 as the original AE file's tensors (LDM names, `bn.*` as they are)."""
    state = vae.state_dict()
    return ae_file_tensors({k: v for k, v in state.items() if not k.startswith("bn.")}) | {k: state[k] for k in BN_KEYS}


def folder_is_dev(path: str) -> bool:
    """Whether a diffusers FLUX.2 folder is dev's (its text_encoder/ a Mistral3 model), from its config.json."""
    try:
        return part_config(path, "text_encoder").get("model_type") == "mistral3"
    except (OSError, ValueError):
        return False


class _Processor:
    """AutoProcessor (FLUX.2-dev's tokenizer/ is a PixtralProcessor), or the tokenizer alone where the processor
    cannot load (its image processor needs torchvision; the text path uses only apply_chat_template)."""

    @staticmethod
    def from_pretrained(folder: str, subfolder: str):
        from transformers import AutoProcessor, AutoTokenizer

        try:
            return AutoProcessor.from_pretrained(folder, subfolder=subfolder)
        except Exception:  # noqa: BLE001 - e.g. ModuleNotFoundError (torchvision): the tokenizer carries the text path
            return AutoTokenizer.from_pretrained(folder, subfolder=subfolder)


def load_folder(path: str, scratch_seed: Optional[int]) -> dict:
    """The four parts of a diffusers FLUX.2 folder, by the libraries' own from_pretrained (klein's text encoder,
    saved as Qwen3ForCausalLM, read as its Qwen3Model; dev's Mistral3ForConditionalGeneration cut to its language
    model: neither LM head nor vision tower is used)."""
    AutoencoderKLFlux2, Flux2Transformer2DModel = diffusers_classes("AutoencoderKLFlux2", "Flux2Transformer2DModel")
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3Model

    dev = folder_is_dev(path)
    classes = {"transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2,
               "text_encoder": Mistral3ForConditionalGeneration if dev else Qwen3Model,
               "tokenizer": _Processor if dev else AutoTokenizer}
    parts = load_folder_parts(path, classes, "FLUX.2",
                              scratch=None if scratch_seed is None else ("transformer", scratch_seed))
    if dev:
        parts["text_encoder"] = language_model(parts["text_encoder"])
    else:
        parts["tokenizer"].padding_side = "right"
    return parts


def load_text_encoder(options, dtype: torch.dtype, tokenizer_cache_dir: Optional[str]):
    """(encoder, tokenizer) of --qwen3 or --mistral3."""
    if options.mistral3:
        return load_mistral3(options.mistral3, dtype, tokenizer_cache_dir, tiny_processor=build_mistral_tokenizer,
                             tiny_vocab=mistral_tokenizer_size())
    return load_qwen3(options.qwen3, dtype, tokenizer_cache_dir, tokenizer_repo=QWEN3_TOKENIZER_REPO,
                      tiny_tokenizer=build_qwen3_tokenizer)


def check_pairing(path: str, transformer, text_encoder, model_version: Optional[str]) -> None:
    """One-line ModelLoadError when the DiT and text encoder are not one FLUX.2 model, or --model_version names
    another one: dev = guidance embedding + Mistral (layers 10/20/30), klein = no guidance + Qwen3 (9/18/27)."""
    dev = bool(transformer.config.guidance_embeds)
    mistral = text_encoder.config.model_type == "mistral"
    if dev != mistral:
        raise ModelLoadError(
            f"{path}: a FLUX.2 {'[dev]' if dev else '[klein]'} DiT ({'with' if dev else 'no'} guidance embedding) "
            f"with a {'Mistral' if mistral else 'Qwen3'} text encoder; {'dev' if dev else 'klein'} reads "
            f"{'Mistral-Small-3.1 (--mistral3)' if dev else 'Qwen3 (--qwen3)'}")
    layers = MISTRAL_TEXT_LAYERS if dev else TEXT_LAYERS
    width = text_encoder.config.hidden_size * len(layers)
    if width != transformer.config.joint_attention_dim:
        raise ModelLoadError(f"{path}: the DiT reads {transformer.config.joint_attention_dim} text features, the text "
                             f"encoder gives {len(layers)} x {text_encoder.config.hidden_size} = {width} (another "
                             f"size's encoder?)")
    if model_version is not None and (model_version == "dev") != dev:
        raise ModelLoadError(f"--model_version {model_version}: the files are FLUX.2 {'[dev]' if dev else '[klein]'} "
                             f"({'guidance embedding, Mistral text' if dev else 'no guidance, Qwen3 text'})")


def preset_modules(name: str) -> dict:
    """A preset's parts as loading gives them (dev's Mistral3 cut to its language model, as from its folder)."""
    parts = build_flux2_modules(name)
    if PRESETS[name].mistral is not None:
        parts["text_encoder"] = language_model(parts["text_encoder"])
    return parts


def load_flux2_components(opts: LoadOptions, options) -> Components:
    """Components of FLUX.2 klein: denoiser = Flux2Transformer2DModel, text encoders = [Qwen3Model],
    tokenizers = [Qwen's], vae = AutoencoderKLFlux2 (`options`: Flux2Options with --qwen3 / --ae)."""
    path = opts.pretrained_model_name_or_path
    kind = flux2_source_kind(path)
    if kind == "single_file":
        check_text_flag(path, options)
    ae_path = options.ae or opts.vae
    given = options.qwen3 or options.mistral3
    text_file = (lambda: load_text_encoder(options, opts.dtype, opts.tokenizer_cache_dir)) if given else None
    parts, scratch_done = load_dit_parts(opts, kind, ae_path, dit_file=load_dit_file, text_file=text_file,
                                         ae_file=load_ae_file, preset=preset_modules, folder=load_folder)
    check_pairing(path, parts["transformer"], parts["text_encoder"], options.model_version)
    return finish_components(opts, parts["transformer"], [parts["text_encoder"]], [parts["tokenizer"]], parts["vae"],
                             ae_path, scratch_done=scratch_done)


def dit_file_is_dev(path: str) -> bool:
    """Whether a FLUX.2 DiT file has the guidance embedding (dev), from its header."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return any(k.endswith("guidance_in.in_layer.weight") for k in f.keys())
    except (OSError, ValueError, RuntimeError):
        return False


def check_text_flag(path: str, options) -> None:
    """A DiT file names its text encoder file: --mistral3 for dev (guidance_in), --qwen3 for klein."""
    dev = dit_file_is_dev(path)
    flag, other = ("mistral3", options.qwen3) if dev else ("qwen3", options.mistral3)
    if other:
        raise ModelLoadError(f"--{'qwen3' if dev else 'mistral3'}: {path} is FLUX.2 {'[dev]' if dev else '[klein]'}, "
                             f"whose text encoder is given with --{flag}")
    if not getattr(options, flag):
        raise ModelLoadError(f"--{flag}: required with a FLUX.2 {'[dev]' if dev else '[klein]'} DiT file ({path})")


def check_model_source(path: str, options, vae: Optional[str]) -> None:
    """The checks of load_flux2_components that need no weights (one-line ModelLoadError)."""
    if flux2_source_kind(path) == "single_file":
        check_text_flag(path, options)
        if not (options.ae or vae):
            raise ModelLoadError(f"--ae: required with a FLUX.2 DiT file ({path})")


def block_counts(path: str) -> Optional[tuple[int, int]]:
    """(double, single) blocks of a preset, folder or DiT file, read without loading weights; None when unknown."""
    try:
        kind = flux2_source_kind(path)
        if kind == "preset":
            return PRESETS[path].double_layers, PRESETS[path].single_layers
        if kind == "diffusers":
            config = part_config(path, "transformer")
            return int(config["num_layers"]), int(config["num_single_layers"])
        double = indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?double_blocks\.(\d+)\.")
        single = indexed_blocks_in_file(path, r"(?:model\.diffusion_model\.)?single_blocks\.(\d+)\.")
        return (double, single) if double and single else None
    except (OSError, ValueError, KeyError, ModelLoadError):
        return None


# --- writing -------------------------------------------------------------------------------------------

def write_dit_file(transformer, path: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict] = None) -> str:
    """The DiT as one original-layout file (BFL's / ComfyUI's names)."""
    write_safetensors(layout.to_original(transformer.state_dict()), path, metadata or {}, dtype=dtype)
    return path


def scheduler():
    """FLUX.2 klein's scheduler config: flow-match Euler, dynamic exponential shift (μ from the image size)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def text_encoder_for_pipeline(text_encoder):
    """The Qwen3Model inside a Qwen3ForCausalLM (the class the klein folder holds; its head tied, nothing new)."""
    from transformers import Qwen3ForCausalLM

    config = text_encoder.config
    with torch.device("meta"):
        full = Qwen3ForCausalLM(config)
    full.model = text_encoder
    full.lm_head.weight = text_encoder.embed_tokens.weight
    return full.eval()


def write_diffusers_folder(parts: dict, out_dir: str) -> str:
    """A diffusers folder of `parts` (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/), by
    the libraries' own save_pretrained: Flux2KleinPipeline's (text_encoder/ as Qwen3ForCausalLM) or, for a Mistral3
    text encoder, Flux2Pipeline's (FLUX.2 [dev])."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    if parts["text_encoder"].config.model_type == "mistral3":
        pipe = Flux2Pipeline(scheduler=scheduler(), vae=parts["vae"], text_encoder=parts["text_encoder"],
                             tokenizer=parts["tokenizer"], transformer=parts["transformer"])
    else:
        pipe = Flux2KleinPipeline(scheduler=scheduler(), vae=parts["vae"],
                                  text_encoder=text_encoder_for_pipeline(parts["text_encoder"]),
                                  tokenizer=parts["tokenizer"], transformer=parts["transformer"], is_distilled=True)
    pipe.save_pretrained(out_dir)
    return out_dir


def write_flux2_preset(name: str, out_dir: str) -> dict[str, str]:
    """A preset written as the files users have: the diffusers folder (`diffusers/`), and the single files: the DiT
    (BFL names), the AE (flux2-vae.safetensors: LDM names, `bn.*`) and the text encoder: klein's
    qwen_3_4b.safetensors (`model.*` keys, ComfyUI's), dev's Mistral3 as the FLUX.2-dev repository holds it
    (transformers' keys `language_model.model.*`, `vision_tower.*`, ...; `text_encoder/` of the folder is the
    same in shards). Returns {"diffusers", "dit", "qwen3" or "mistral3", "ae"}."""
    parts = build_flux2_modules(name)
    dev = PRESETS[name].mistral is not None
    os.makedirs(out_dir, exist_ok=True)
    text_key, text_file = ("mistral3", "mistral_3_small_flux2.safetensors") if dev else ("qwen3", "qwen_3_4b.safetensors")
    paths = {"diffusers": os.path.join(out_dir, "diffusers"),
             "dit": os.path.join(out_dir, "flux2-dev-tiny.safetensors" if dev else "flux-2-klein-tiny.safetensors"),
             text_key: os.path.join(out_dir, text_file),
             "ae": os.path.join(out_dir, "flux2-vae.safetensors")}
    write_diffusers_folder(parts, paths["diffusers"])
    write_dit_file(parts["transformer"], paths["dit"])
    if dev:
        from safetensors.torch import load_file

        # the keys transformers writes for Mistral3ForConditionalGeneration (those of FLUX.2-dev's text_encoder/)
        text_state = load_file(os.path.join(paths["diffusers"], "text_encoder", "model.safetensors"))
    else:
        text_state = {"model." + k: v for k, v in parts["text_encoder"].state_dict().items()}
    write_safetensors(text_state, paths[text_key])
    write_safetensors(flux2_ae_file_tensors(parts["vae"]), paths["ae"])
    return paths
