"""sd-scripts' gen_img.py / sdxl_gen_img.py flags on top of tools/generate.py's parser: each of its 93 flags is
implemented by the generator, accepted with nothing to do (with the reason), or refused with one line when used
(docs/gen_img.md)."""

from __future__ import annotations

import argparse

from library.core.errors import ConfigError

# sd-scripts gen_img.py flags accepted with nothing to do here (docs/gen_img.md): flag -> (takes values, why).
GEN_IMG_ACCEPTED = {
    "--xformers": (False, "attention runs in PyTorch SDPA"),
    "--sdpa": (False, "attention runs in PyTorch SDPA"),
    "--diffusers_xformers": (False, "attention runs in PyTorch SDPA"),
    "--no_half_vae": (False, "the VAE always runs in float32"),
    "--opt_channels_last": (False, "a memory layout; the same images"),
    "--vae_batch_size": (True, "the VAE decodes each batch; the same images"),
    "--vae_slices": (True, "the VAE decodes whole images; the same images"),
    "--v1": (False, "the model's version is read from the model"),
    "--no_preview": (False, "there is no interactive mode"),
    "--tokenizer_cache_dir": (True, "tokenizers come with the model or the presets"),
}
# sd-scripts gen_img.py flags accepted by the parser but refused when used: not implemented (docs/gen_img.md).
GEN_IMG_REFUSED = {
    "--highres_fix_upscaler": "upscaler modules are not supported; the highres fix upscales with LANCZOS",
    "--highres_fix_upscaler_args": "upscaler modules are not supported",
    "--highres_fix_save_1st": "the first stage's images are not saved",
    "--highres_fix_disable_control_net": "no ControlNet in the highres fix",
    "--network_regional_mask_max_color_codes": "regions come from the mask's R, G, B channels",
    "--network_args": "networks are built from their files",
    "--network_pre_calc": "use --network_merge",
    "--network_merge_n_models": "--network_merge merges every network",
    "--network_show_meta": "use tools/show_metadata.py",
    "--textual_inversion_embeddings": "textual inversion embeddings are not supported by this generator yet",
    "--interactive": "no interactive mode",
    "--n_iter": "use --images_per_prompt",
    "--iter_same_seed": "use --seed or the prompt option --d",
    "--shuffle_prompts": "prompts run in file order",
    "--negative_scale": "one CFG scale for the negative prompt",
    "--max_embeddings_multiples": "prompts of any length are split into 75-token windows",
    "--emb_normalize_mode": "weighted prompts are scaled as tools/generate.py scales them",
    "--from_module": "prompts come from --prompt or --from_file",
    "--prompter_module_args": "prompts come from --prompt or --from_file",
    "--sequential_file_name": "files are named im_NN_<time>_<seed>.png",
    "--use_original_file_name": "files are named im_NN_<time>_<seed>.png",
    "--replace_clip_l14_336": "the model's own text encoder is used",
    "--force_scheduler_zero_steps_offset": "the scheduler keeps SD's steps_offset",
    "--zero_terminal_snr": "not available in generation",
    "--ddim_eta": "DDIM runs with eta 0",
    "--original_width": "SDXL size conditioning is the image's size",
    "--original_height": "SDXL size conditioning is the image's size",
    "--original_width_negative": "SDXL size conditioning is the image's size",
    "--original_height_negative": "SDXL size conditioning is the image's size",
    "--crop_top": "SDXL crop conditioning is (0, 0)",
    "--crop_left": "SDXL crop conditioning is (0, 0)",
    "--noise_offset_prob": "no noise offset in generation",
    "--noise_offset_range": "no noise offset in generation",
    "--pyramid_noise_prob": "no pyramid noise in generation",
    "--pyramid_noise_discount_range": "no pyramid noise in generation",
    "--guide_image_path": "ControlNet is not supported by gen_img.py here",
    "--control_net_models": "ControlNet is not supported by gen_img.py here",
    "--control_net_lllite_models": "ControlNet-LLLite is not supported by gen_img.py here",
    "--control_net_preps": "ControlNet is not supported by gen_img.py here",
    "--control_net_multipliers": "ControlNet is not supported by gen_img.py here",
    "--control_net_ratios": "ControlNet is not supported by gen_img.py here",
    "--clip_vision_strength": "no CLIP Vision conditioning",
    "--ds_depth_1": "no Deep Shrink", "--ds_timesteps_1": "no Deep Shrink", "--ds_depth_2": "no Deep Shrink",
    "--ds_timesteps_2": "no Deep Shrink", "--ds_ratio": "no Deep Shrink",
    "--gradual_latent_timesteps": "no Gradual Latent", "--gradual_latent_ratio": "no Gradual Latent",
    "--gradual_latent_ratio_step": "no Gradual Latent", "--gradual_latent_every_n_steps": "no Gradual Latent",
    "--gradual_latent_s_noise": "no Gradual Latent", "--gradual_latent_unsharp_params": "no Gradual Latent",
}
# sd-scripts store_true flags among the refused ones; every other refused flag takes values (any number, any text).
_GEN_IMG_SWITCHES = {"--highres_fix_save_1st", "--highres_fix_disable_control_net",
                     "--network_pre_calc", "--network_show_meta", "--interactive", "--iter_same_seed",
                     "--shuffle_prompts", "--sequential_file_name", "--use_original_file_name",
                     "--replace_clip_l14_336", "--force_scheduler_zero_steps_offset", "--zero_terminal_snr"}
GEN_IMG_HARMLESS = {"--n_iter": 1.0, "--ddim_eta": 0.0}  # values that ask for what this generator does anyway


def as_gen_img_parser(p: argparse.ArgumentParser, sdxl: bool = False) -> argparse.ArgumentParser:
    """`p` (tools/generate.py's parser) as gen_img.py / sdxl_gen_img.py: sd-scripts' gen_img defaults (--steps 50,
    --outdir outputs) and its other flags accepted (no-op) or refused when used."""
    p.description = "sd-scripts' " + ("sdxl_gen_img.py" if sdxl else "gen_img.py") + ": " + p.description
    p.set_defaults(steps=50, outdir="outputs")
    for action in p._actions:
        if "--outdir" in action.option_strings:
            action.required = False
    known = {s for action in p._actions for s in action.option_strings}
    g = p.add_argument_group("sd-scripts gen_img flags accepted with nothing to do")
    for flag, (values, why) in GEN_IMG_ACCEPTED.items():
        if flag not in known:
            kind = {"nargs": "*", "metavar": "VALUE"} if values else {"action": "store_true"}
            g.add_argument(flag, help=f"accepted: {why}", **kind)
    g = p.add_argument_group("sd-scripts gen_img flags refused when used (not implemented)")
    for flag, why in GEN_IMG_REFUSED.items():
        if flag in known:  # implemented by the generator (another branch may add it)
            continue
        if flag in _GEN_IMG_SWITCHES:
            g.add_argument(flag, action="store_true", help=f"refused: {why}")
        else:
            g.add_argument(flag, nargs="*", default=None, metavar="VALUE", help=f"refused: {why}")
    return p


def check_gen_img_refused(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ConfigError for the first refused gen_img flag that was used."""
    for action in parser._actions:
        flag = next((s for s in action.option_strings if s in GEN_IMG_REFUSED), None)
        if flag is None or not (action.help or "").startswith("refused"):
            continue
        value = getattr(args, action.dest)
        if value in (None, False) or _harmless(flag, value):
            continue
        raise ConfigError(f"{flag}: not implemented ({GEN_IMG_REFUSED[flag]}); see docs/gen_img.md")


def _harmless(flag: str, value) -> bool:
    try:
        return flag in GEN_IMG_HARMLESS and len(value) == 1 and float(value[0]) == GEN_IMG_HARMLESS[flag]
    except ValueError:
        return False
