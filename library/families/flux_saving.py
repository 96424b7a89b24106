"""Writing a FLUX.1 model as a diffusers folder (what merge_lora --sd_model produces for Flux)."""

from __future__ import annotations

from library.families.sd_saving import write_diffusers_folder

# As FluxPipeline.save_pretrained writes it, without importing the pipeline.
_MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
}
# FLUX.1-dev's scheduler settings (dynamic shifting by image size).
_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                  base_image_seq_len=256, max_image_seq_len=4096)


def save_flux_diffusers_folder(parts: dict, out_dir: str) -> None:
    """A folder the Flux loader (and diffusers' FluxPipeline) reads; written atomically."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    names = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    model_index = {**_MODEL_INDEX, "_diffusers_version": diffusers.__version__}
    write_diffusers_folder({**{n: parts[n] for n in names}, "scheduler": FlowMatchEulerDiscreteScheduler(**_SCHEDULER)},
                           model_index, out_dir)
