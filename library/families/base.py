"""The interface every model family implements; the training loop knows only this.

A family package (library/families/sd/, sdxl/, flux/, ...) owns everything model-specific:
loading, tokenising, text encoding, the noise scheme, the model call, the LoRA
targets and their kohya names, and the strings written into metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
import os
from typing import Any, ClassVar, Mapping, Optional

import torch
from torch import nn

from library.core.errors import ConfigError, UserError
from library.families import model_saving
from library.objectives.noise import DDPMSchedule, NoiseScheme
from library.objectives.posterior import posterior_sample
from networks.lora_args import BlockLayout
from networks.lora_targets import LoraTarget


# --save_model_as of the full-model scripts (sd-scripts' names): one original-layout file, or a diffusers
# folder with .bin (torch pickle) or .safetensors weights.
SAVE_FORMATS = ("ckpt", "safetensors", "diffusers", "diffusers_safetensors")


def model_save_path(output_dir: str, stem: str, fmt: str) -> str:
    """Where a model saved as `fmt` goes: `<stem>.ckpt` / `<stem>.safetensors`, or the folder `<stem>`."""
    model_saving.check_save_format(fmt, SAVE_FORMATS)
    return os.path.join(output_dir, stem if fmt in model_saving.FOLDER_FORMATS else f"{stem}.{fmt}")


def check_single_file_name(out: str, single_file: bool) -> None:
    """UserError unless a --single_file preset goes to a .safetensors / .ckpt name."""
    if single_file and not out.lower().endswith((".safetensors", ".ckpt")):
        raise UserError(f"--out {out}: with --single_file expected a .safetensors or .ckpt file name")


def check_folder_name(out: str, why: str) -> None:
    """UserError when a preset written as several files is given a .safetensors name (`why` says so)."""
    if out.lower().endswith(".safetensors"):
        raise UserError(f"--out {out}: {why}; expected a folder name")


class ModelLoadError(UserError):
    """A model path/preset could not be loaded; the message is one line for the user."""


@dataclass
class LoadOptions:
    """What a family needs to load a model (translated from flags in library/cli/model.py)."""
    pretrained_model_name_or_path: str
    vae: Optional[str] = None
    v2: bool = False
    v_parameterization: bool = False
    dtype: torch.dtype = torch.float32
    vae_dtype: torch.dtype = torch.float32
    tokenizer_cache_dir: Optional[str] = None
    # DDPM schedule overrides (--noise_scheduler_overrides, --timestep_spacing); None: the family's own schedule.
    noise_schedule: Optional[DDPMSchedule] = None
    # The family's own options (an instance of its options_type; None: the defaults). Loading may need them
    # (FLUX.1's --clip_l / --t5xxl / --ae) and the loaded Components carry them for every later call.
    family_options: Any = None
    # --from_scratch: build the denoiser from its config with weights drawn from torch.manual_seed(init_seed)
    # (--seed) instead of loading them; the VAE and text encoders are still loaded.
    from_scratch: bool = False
    init_seed: int = 0


@dataclass
class Components:
    """The loaded parts of one model. `denoiser` is the UNet (or DiT transformer)."""

    denoiser: nn.Module
    vae: nn.Module
    text_encoders: list[nn.Module]
    tokenizers: list[Any]
    v_parameterization: bool = False
    v2: bool = False
    model_path: str = ""  # what the user passed (for ss_sd_model_name and hashes)
    vae_path: Optional[str] = None
    options: Any = None  # the family's options of this run (LoadOptions.family_options, defaults filled in)
    noise_schedule: Optional[DDPMSchedule] = None  # LoadOptions.noise_schedule: training scheme and sample images
    # A ControlNet (the control scripts, tools/generate.py --control_net): `predict` adds its residuals when the
    # batch holds "conditioning_images" (B, 3, H, W) in 0..1. None: the plain model.
    controlnet: Optional[nn.Module] = None




@dataclass
class TextConditioning:
    """Output of `encode_text`: tensors the denoiser needs, batch-first."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class NoOptions:
    """The options of a family that declares none of its own."""


class ModelFamily(ABC):
    """The interface of a model family. Families are stateless: what one run chose lives in its options
    (an `options_type` instance), which `load` puts on the Components every later call receives.

    Subclasses set the class attributes and implement the abstract methods; the others have defaults
    that a family overrides where its model differs.
    """

    name: ClassVar[str] = ""  # "sd", "sdxl", "flux"
    # Facts about the family's files, read by library/families/detect.py: the tensor-name prefixes only this
    # family's single files carry, (prefix, "what the file holds") pairs for "expected X, found Y" errors, the
    # substrings of a diffusers model_index.json `_class_name` that name it, and the order families are tried in
    # (lowest first: the most specific markers first, SDXL before SD).
    single_file_markers: ClassVar[tuple[str, ...]] = ()
    contents: ClassVar[tuple[tuple[str, str], ...]] = ()
    diffusers_class_markers: ClassVar[tuple[str, ...]] = ()
    detect_rank: ClassVar[int] = 100
    # The family's entry scripts by mode ("lora": its train_network script, "finetune": its full fine-tune one,
    # "controlnet_lllite": SDXL's ControlNet-LLLite script, a network run over a frozen model);
    # a family trained through another's scripts (Chroma: FLUX.1's) names those, with the --model_type values
    # that select it there (None: the scripts' default).
    scripts: ClassVar[dict[str, str]] = {}
    model_types: ClassVar[tuple[Optional[str], ...]] = ()
    # sd-scripts' family selector flag of the shared tools (cache tools, generate: --sdxl, --flux); a family that
    # such a flag reaches through its --model_type names the family it is a variant of.
    selector_flag: ClassVar[Optional[str]] = None
    variant_of: ClassVar[Optional[str]] = None
    # What people call the parts: one label per text encoder (in encoder order) and the denoiser.
    text_encoder_labels: ClassVar[tuple[str, ...]] = ()
    denoiser_label: ClassVar[str] = "UNet"
    # Its options_type fields that name a component file (FLUX.1's --clip_l / --t5xxl / --ae): the tools that
    # load a model (generate, merge, extract, resize) take them too.
    component_file_flags: ClassVar[tuple[str, ...]] = ()
    # sd-scripts' family-specific spellings of a shared flag: (its flag, the shared flag it stands for).
    flag_aliases: ClassVar[tuple[tuple[str, str], ...]] = ()
    # The tiny presets tools/make_tiny_model.py writes (its --family is the name after "tiny:").
    tiny_presets: ClassVar[tuple[str, ...]] = ()
    # The dataclass of this family's own options. Its fields (with help text in their metadata; nested
    # dataclasses flattened) become the script's flags, named as the fields (library/cli/options.py).
    options_type: ClassVar[type] = NoOptions
    latent_cache_arch: ClassVar[str] = ""  # suffix of disk latent caches: "_sd", "_sdxl", "_flux"
    # Disk latent keys carry the latent size, `latents_<h>x<w>` (h, w = bucket size / this stride), as
    # sd-scripts' Flux caches do; None: plain `latents` keys (SD, SDXL).
    latent_cache_key_stride: ClassVar[Optional[int]] = None
    latent_channels: ClassVar[int] = 4
    vae_scale_factor: ClassVar[int] = 8
    latents_scale: ClassVar[float] = 0.18215  # applied at train time; caches hold unscaled latents
    latents_shift: ClassVar[float] = 0.0
    bucket_reso_multiple: ClassVar[int] = 64  # bucket_reso_steps must be a multiple of this
    # Whether the script takes --cache_text_encoder_outputs (SDXL, FLUX.1), and the suffix of its disk files
    # beside each image (None: `_te_outputs.npz`).
    supports_text_cache: ClassVar[bool] = False
    text_cache_suffix: ClassVar[Optional[str]] = None
    # The TextConditioning keys each text encoder produces, in encoder order. Given, the outputs of frozen
    # encoders can be cached while another one trains (Flux: T5 cached, CLIP-L trained, as sd-scripts
    # allows); empty: the outputs are cached all together or not at all.
    text_encoder_outputs: ClassVar[tuple[tuple[str, ...], ...]] = ()
    # The `ss_network_module` sd-scripts writes for this family's LoRA ("networks.lora" for SD/SDXL,
    # "networks.lora_flux" for FLUX.1): files trained with the project's LoRA say this, whichever of its
    # names (networks.lora, networks.lora_flux, ...) the command line used.
    lora_network_module: ClassVar[str] = "networks.lora"
    # Why a --network_module other than networks.lora (e.g. lycoris.kohya) cannot train this family; None: it can.
    external_networks_unsupported: ClassVar[Optional[str]] = None
    # (class a LyCORIS preset names, this family's class that plays its role): a preset listing the
    # first also wraps modules of the second (Flux: BFL block classes -> diffusers block classes).
    lycoris_module_aliases: ClassVar[tuple[tuple[str, str], ...]] = ()
    # The denoiser's repeated block classes: the units of FSDP's TRANSFORMER_BASED_WRAP
    # (library/cli/accelerate_config.py) and of regional compilation (--torch_compile, library/train/memory/compile.py).
    block_classes: ClassVar[tuple[str, ...]] = ()
    # How many text encoders, from the first, a full fine-tune's --train_text_encoder trains (SD3: CLIP-L and
    # CLIP-G, not T5, as sd-scripts' sd3_train.py); None: all of them.
    fine_tune_text_encoders: ClassVar[Optional[int]] = None
    # The text encoder that a full fine-tune trains only with --train_t5xxl (SD3: 2, T5-XXL, as sd-scripts'
    # sd3_train.py, with its rate --learning_rate_te3); None: the family's fine-tune has no --train_t5xxl.
    fine_tune_t5xxl_encoder: ClassVar[Optional[int]] = None
    # --context_parallel_size: the pixels per image token side when the denoiser is a diffusers model with a
    # context-parallel plan (`_cp_plan`) and a fixed text length (FLUX.1: 16, 8x VAE x 2x2 patches), so every
    # bucket's tokens can be checked against the split before training; None: no context parallelism.
    context_parallel_token_pixels: ClassVar[Optional[int]] = None
    # --tensor_parallel_size: whether the denoiser is a diffusers model whose own tensor-parallel plan (`_tp_plan`)
    # shards its Linear layers (library/train/distributed/tensor_parallel.py); False: no tensor parallelism.
    tensor_parallel: ClassVar[bool] = False
    # Whether some of the denoiser's weights never reach the loss (Qwen-Image: the last block's text stream, whose
    # output nothing reads), so DDP must look for unused trained weights every step (find_unused_parameters).
    denoiser_leaves_weights_unused: ClassVar[bool] = False

    # --- options ---------------------------------------------------------------
    @classmethod
    def presets(cls) -> Mapping[str, Any]:
        """The built-in presets ("tiny:sd1", "random:sd15", ...) by name."""
        return {}

    @classmethod
    def supports_block_swap(cls) -> bool:
        """Whether the family streams its blocks (--blocks_to_swap): it overrides `swappable_blocks`."""
        return cls.swappable_blocks is not ModelFamily.swappable_blocks

    @classmethod
    def write_preset(cls, preset: str, out: str, *, single_file: bool = False,
                     separate_text_encoders: bool = False) -> dict[str, str]:
        """Write the preset `preset` (one of `tiny_presets`) to `out` as the family's files; {what: path}.
        UserError when `out` or the layout does not suit the family."""
        raise UserError(f"{cls.name}: no preset writer")

    @classmethod
    def preset_hint(cls, written: Mapping[str, str]) -> str:
        """The flags that train on files `write_preset` wrote ("" when the model path alone is enough)."""
        return ""

    @classmethod
    def facts(cls) -> dict[str, Any]:
        """Everything the tools and the web UI need to know about the family, as JSON-able data."""
        return {
            "name": cls.name,
            "scripts": dict(cls.scripts),
            "model_types": list(cls.model_types),
            "variant_of": cls.variant_of,
            "selector_flag": cls.selector_flag,
            "text_encoder_labels": list(cls.text_encoder_labels),
            "denoiser_label": cls.denoiser_label,
            "block_swap": cls.supports_block_swap(),
            "context_parallel": cls.context_parallel_token_pixels is not None,
            "tensor_parallel": cls.tensor_parallel,
            "component_file_flags": list(cls.component_file_flags),
            "flag_aliases": {alias: flag for alias, flag in cls.flag_aliases},
            "lora_network_module": cls.lora_network_module,
            "save_formats": list(cls.save_formats),
            "presets": list(cls.presets()),
            "tiny_presets": list(cls.tiny_presets),
            "single_file_markers": list(cls.single_file_markers),
            "contents": [list(pair) for pair in cls.contents],
            "diffusers_class_markers": list(cls.diffusers_class_markers),
        }

    def options(self, components: Components) -> Any:
        """The run's options carried by `components` (the defaults when loaded without any)."""
        return components.options if components.options is not None else self.options_type()

    def check_options(self, options: Any, model: LoadOptions, *, blocks_to_swap: Optional[int] = None,
                      min_timestep: Optional[int] = None, max_timestep: Optional[int] = None,
                      zero_terminal_snr: bool = False) -> None:
        """Check this family's options against the rest of the run before anything loads (one-line ConfigError)."""

    # Edit training: what in this family takes control images (named when a dataset has them but the run does not).
    control_hint: ClassVar[str] = ""

    def max_control_images(self, options: Any) -> int:
        """How many control images (the subset key control_directory) each training image may have with these
        options; 0: none (the model takes no reference images)."""
        return 0

    def text_key(self, components: "Components", caption: str, control_paths: tuple[str, ...]) -> str:
        """What a sample's text conditioning is computed from, as the string `tokenize` takes and the text cache keys
        on: its caption; a family whose text encoder also reads the control images (Qwen-Image-Edit) puts them in."""
        return caption

    def latent_cache_values(self, options: Any) -> dict[str, Any]:
        """The options that change what the VAE outputs (part of the latent-cache validity key)."""
        return {}

    def text_cache_values(self, options: Any) -> dict[str, Any]:
        """The options that change what the text encoders output (part of the text-cache validity key)."""
        return {}

    def metadata_values(self, options: Any) -> dict[str, Any]:
        """The options that saved LoRAs record, as ss_<name> metadata."""
        return {}

    def context_parallel_refusal(self, options: Any) -> Optional[str]:
        """What of this run's family `options` keeps --context_parallel_size from splitting the tokens ("--flag
        (why)"), None when nothing does."""
        return None

    def check_loaded(self, components: Components, text: Any) -> None:
        """Check the run's text options (`text`: TextEncodingOptions) against the loaded model, before step 1
        (one-line ConfigError): by default --clip_skip against the layer count of each CLIP text encoder."""
        clip_skip = getattr(text, "clip_skip", None)
        if clip_skip is None:
            return
        for i, encoder in enumerate(components.text_encoders):
            layers = getattr(getattr(encoder, "config", None), "num_hidden_layers", None)
            if isinstance(layers, int) and clip_skip > layers:
                which = f"text encoder {i + 1}" if len(components.text_encoders) > 1 else "the text encoder"
                raise ConfigError(f"--clip_skip {clip_skip}: {which} of this model has {layers} layers; "
                                  f"expected 1 to {layers} (2 = penultimate)")

    def prepare_for_data(self, components: Components, resolutions: list[tuple[int, int]]) -> None:
        """Adjust the loaded model to the run's training resolutions (width, height) of every dataset, before
        step 1 (SD3.5's scaled position embeddings); by default nothing."""

    # --- loading -----------------------------------------------------------
    @abstractmethod
    def load(self, opts: LoadOptions) -> Components:
        """Load every part; the Components carry `opts.family_options` (or the defaults) as `options`."""

    # --- text --------------------------------------------------------------
    @abstractmethod
    def tokenize(self, components: Components, captions: list[str], max_token_length: Optional[int]) -> list[torch.Tensor]:
        """One LongTensor per tokenizer, shape (B, n_chunks * 77) for CLIP families."""

    @abstractmethod
    def encode_text(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int]) -> TextConditioning:
        """The conditioning tensors of tokenized captions."""

    # --weighted_captions ("(word:1.2)" in training captions): the families where sd-scripts takes it (SD, SDXL).
    supports_weighted_captions: ClassVar[bool] = False
    # Textual inversion (library/families/common/embeddings.py): the embedding file's key of each text encoder, in
    # the encoders' order (sd-scripts' names); empty: the family has no textual-inversion script.
    textual_inversion_keys: ClassVar[tuple[str, ...]] = ()

    def encode_weighted_captions(self, components: Components, captions: list[str], clip_skip: Optional[int],
                                 max_token_length: Optional[int], device: torch.device) -> TextConditioning:
        """The conditioning of captions with prompt weights, in the same layout as `encode_text`."""
        raise NotImplementedError(f"--weighted_captions: not supported for {self.name}")

    def encode_text_with(self, components: Components, tokens: list[torch.Tensor], clip_skip: Optional[int],
                         encoders: frozenset[int]) -> TextConditioning:
        """The outputs of only the text encoders numbered in `encoders` (see text_encoder_outputs).

        This default encodes with all of them and keeps those keys; a family overrides it to run
        only the encoders asked for.
        """
        text = self.encode_text(components, tokens, clip_skip)
        keep = {key for i in encoders for key in self.text_encoder_outputs[i]}
        return TextConditioning({k: v for k, v in text.tensors.items() if k in keep})

    # --- images ------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae: nn.Module, images: torch.Tensor,
                      generator: Optional[torch.Generator | Sequence[torch.Generator]] = None) -> torch.Tensor:
        """Images in [-1, 1] (B,3,H,W) -> unscaled latents (B,C,H/8,W/8), float32.

        The posterior sample draws from `generator`; a sequence holds one generator per image
        (library/objectives/posterior.py: the trainer passes each image's own).
        """
        dist = vae.encode(images.to(vae.device, vae.dtype)).latent_dist
        if isinstance(generator, Sequence):
            return posterior_sample(dist, generator)
        return dist.sample(generator=generator).float()

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.latents_shift) * self.latents_scale

    # --- denoising -----------------------------------------------------------
    @abstractmethod
    def noise_scheme(self, components: Components, zero_terminal_snr: bool = False) -> NoiseScheme:
        """The noise/timestep scheme (library/objectives) this family trains with."""

    @abstractmethod
    def predict(self, components: Components, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                text: TextConditioning, batch: dict) -> torch.Tensor:
        """The denoiser's output for a batch, in the latent layout of `noisy_latents`."""

    # --- generation ------------------------------------------------------------
    def generate(self, components: Components, requests: list, *, clip_skip: Optional[int] = None,
                 device: Optional[torch.device] = None) -> list:
        """Denoise one batch of library.sampling.generate.GenerationRequests (same size, steps, scale,
        sampler) into GeneratedImages, filling in this family's defaults."""
        raise NotImplementedError(f"{self.name}: image generation is not implemented for this family yet")

    # --- LoRA ----------------------------------------------------------------
    @abstractmethod
    def lora_targets(self, components: Components) -> list[LoraTarget]:
        """The model parts that receive LoRA modules, with their kohya names (networks/lora_targets.py)."""

    def lora_block_layout(self) -> Optional[BlockLayout]:
        """The block layout of block_dims / block lr weights for networks.lora; None: SD's."""
        return None

    def convert_lora_state_dict(self, state_dict: dict) -> dict:
        """A LoRA state dict in this family's kohya naming (e.g. a diffusers-named SDXL file renamed to SGM)."""
        return state_dict

    def canonical_lora_name(self, name: str) -> str:
        """One kohya module name in this family's naming, the names `lora_targets` give (SDXL: a diffusers
        path such as `lora_unet_conv_in` -> `lora_unet_input_blocks_0_0`); unknown names come back as they are."""
        return name

    def variant(self, options: Any) -> "ModelFamily":
        """The family that trains with these options: itself, or a relative its options select (FLUX.1's
        --model_type chroma selects Chroma). Called once the flags are parsed."""
        return self

    def optimizer_block(self, parameter_path: str) -> Optional[str]:
        """--blockwise_fused_optimizers: the block of the denoiser that a parameter (its path in the denoiser)
        belongs to; each block gets its own optimizer. None: the family has no such layout (the flag is refused)."""
        return None

    def denoiser_parameter_groups(self, components: Components, lr: float) -> Optional[list[tuple[str, list, float]]]:
        """A full fine-tune's denoiser groups as (name, parameters, learning rate), a rate of 0 freezing its
        group (Anima: --llm_adapter_lr, --self_attn_lr, ...); None: one group at `lr`."""
        return None

    # --- memory ----------------------------------------------------------------
    def swappable_blocks(self, components: Components, num_swap: int) -> list[nn.Module]:
        """The denoiser blocks --blocks_to_swap N keeps in CPU memory, in forward order.

        A family that streams blocks overrides this (its rule turns N into blocks and checks
        the bound); the default refuses the flag.
        """
        raise UserError(f"--blocks_to_swap is not supported for {self.name}")

    # --- ControlNet (train_control_net.py, sdxl_train_control_net.py, flux_train_control_net.py) -----------
    # Whether its ControlNet copies some of the denoiser's blocks (--num_double_blocks / --num_single_blocks).
    controlnet_block_flags: ClassVar[bool] = False

    def create_controlnet(self, components: Components, path: Optional[str], num_double_blocks: Optional[int] = None,
                          num_single_blocks: Optional[int] = None) -> nn.Module:
        """A new ControlNet initialised from the loaded denoiser, or the one saved at `path` (a diffusers folder or
        one of our single files) to go on training. Float32, on the CPU."""
        raise UserError(f"ControlNet training is not supported for {self.name} (SD 1.x/2.x, SDXL and FLUX.1 are)")

    def save_controlnet(self, controlnet: nn.Module, path: str, fmt: str, dtype: Optional[torch.dtype],
                        metadata: Optional[dict[str, str]]) -> str:
        """Write a ControlNet: a diffusers folder (fmt diffusers / diffusers_safetensors) or one .safetensors file
        in the layout ComfyUI reads (docs/controlnet.md). Atomic. Returns the path written."""
        raise UserError(f"ControlNet training is not supported for {self.name}")

    # --- saving ----------------------------------------------------------------
    # The formats save_model writes for this family (a family without one original-layout format drops it).
    save_formats: ClassVar[tuple[str, ...]] = SAVE_FORMATS

    def save_model(self, components: Components, path: str, fmt: str, dtype: Optional[torch.dtype] = None,
                   metadata: Optional[dict[str, str]] = None, mem_eff: bool = False, *, epoch: int = 0,
                   global_step: int = 0) -> str:
        """Write the whole model (denoiser + text encoders + VAE as the format holds) to `path`; return the path written.

        `fmt`: one of SAVE_FORMATS (see model_save_path for names). `dtype`: --save_precision (floating
        tensors cast as written; None keeps them). `metadata`: safetensors header metadata of a single
        `.safetensors` file (ckpt and folders do not carry it). `mem_eff`: --mem_eff_save, stream each
        safetensors file tensor by tensor. `epoch` / `global_step`: written into a `.ckpt` as sd-scripts
        does (`{"state_dict", "epoch", "global_step"}`); other formats ignore them. The components are not
        changed. Atomic: a complete file / folder or none.
        """
        model_saving.check_save_format(fmt, self.save_formats, self.name, path)
        if fmt in model_saving.FOLDER_FORMATS:
            parts, model_index = self.pipeline_folder(components)
            return model_saving.write_pipeline_folder(parts, model_index, path, fmt == "diffusers_safetensors",
                                                      dtype, mem_eff)
        return model_saving.write_single_file(self.single_file_state_dict(components), path, fmt, dtype,
                                              metadata, mem_eff, epoch=epoch, global_step=global_step)

    def single_file_state_dict(self, components: Components) -> Mapping[str, Any]:
        """The model in its original single-file layout, holding the model's own tensors (not copies); fused or
        derived tensors as library.core.safetensors_io.Deferred, made only when written."""
        raise NotImplementedError(f"model family {self.name!r} cannot save single-file checkpoints yet")

    def pipeline_folder(self, components: Components) -> tuple[dict[str, Any], dict[str, Any]]:
        """({subfolder: model, tokenizer or scheduler}, model_index.json) of this family's diffusers pipeline."""
        raise NotImplementedError(f"model family {self.name!r} cannot save diffusers folders yet")

    def save_checkpoint(self, components: Components, path: str, dtype: Optional[torch.dtype] = None) -> None:
        """Write the whole model as its path names it: a .safetensors / .ckpt file, otherwise a diffusers
        folder with safetensors weights (tools: merged models)."""
        self.save_model(components, path, model_saving.format_of_path(path), dtype)

    # --- metadata --------------------------------------------------------------
    @abstractmethod
    def base_model_version(self, components: Components) -> str:
        """ss_base_model_version: sd_v1, sd_v2, sd_v2_v, sdxl_base_v1-0, flux1."""

    @abstractmethod
    def modelspec_architecture(self, components: Components, resolution: int) -> str:
        """modelspec.architecture without the '/lora' suffix."""

    def modelspec_implementation(self) -> str:
        return "diffusers"

    def modelspec_prediction_type(self, components: Components) -> Optional[str]:
        """modelspec.prediction_type ("epsilon" / "v"); None where sd-scripts writes none (flow models)."""
        return "v" if components.v_parameterization else "epsilon"
