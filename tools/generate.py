"""Generate images from a base model with zero or more LoRA files (the flags of sd-scripts' gen_img.py).

    python tools/generate.py --ckpt model.safetensors --outdir out --prompt "a cat --n blurry --d 42" \
        --network_weights my_lora.safetensors --network_mul 0.8 --steps 30 --sampler euler_a

Prompts come from --prompt or --from_file (.txt, .toml, .json: the sample prompt
formats); inline options (--n --w --h --d --s --l --g --ss) override the flags.
Images are written as <outdir>/im_<NN>_<YYYYmmddHHMMSS>_<seed>.png with the
settings in the PNG text.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library.cli.flux import add_component_file_arguments, component_files  # noqa: E402
from library.cli.gen_img import as_gen_img_parser, check_gen_img_refused  # noqa: E402
from library.cli.image_inputs import add_image_input_arguments, image_inputs_from_args  # noqa: E402
from library.cli.network import LLLITE_MODULE  # noqa: E402
from library.cli.options import options_from_values  # noqa: E402
from library.core.errors import ConfigError, run_tool  # noqa: E402
from library.families.common.embeddings import expand_prompt  # noqa: E402
from library.families import DEFAULT_FAMILY, get_family, selected_family  # noqa: E402
from library.families.detect import detect_family  # noqa: E402
from library.sampling.samplers import sampler_names  # noqa: E402

logger = logging.getLogger("generate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--ckpt", required=True, help="base model: diffusers folder, .safetensors/.ckpt file or preset")
    g.add_argument("--vae", default=None, help="VAE to use instead of the model's own")
    g.add_argument("--v2", action="store_true", help="SD 2.x (detected from the model; kept for compatibility)")
    g.add_argument("--v_parameterization", action="store_true", help="the model predicts v (SD 2.x 768-v)")
    g.add_argument("--sdxl", action="store_true", help="the model is SDXL (default: SD 1.x/2.x)")
    g.add_argument("--flux", action="store_true", help="the model is FLUX.1 (a Chroma file or preset is found as Chroma)")
    add_component_file_arguments(g)
    g.add_argument("--clip_skip", type=int, default=None, help="text encoder layer from the end (2 = penultimate)")
    g.add_argument("--fp16", action="store_true", help="run the model in float16")
    g.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    g.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    g = p.add_argument_group("networks (one value per network)")
    g.add_argument("--network_module", nargs="*", default=[], help="module of each network (default: lycoris.kohya for a file with LyCORIS "
                                                                "modules, else networks.lora)")
    g.add_argument("--network_weights", nargs="*", default=[], help="LoRA / LyCORIS files")
    g.add_argument("--network_mul", nargs="*", type=float, default=[], help="multiplier of each network (default 1)")
    g.add_argument("--merge", "--network_merge", dest="merge", action="store_true",
                   help="merge the networks into the weights first (same images, faster)")
    g.add_argument("--textual_inversion_embeddings", nargs="*", default=[], metavar="FILE",
                   help="textual-inversion embeddings (SD 1.x/2.x, SDXL; .safetensors, A1111 .pt): each one's token "
                        "(the token_string it records, else its file name) can be used in prompts")
    g = p.add_argument_group("ControlNet")
    g.add_argument("--control_net", default=None, help="a ControlNet trained by the ControlNet scripts (a diffusers "
                                                       "folder or .safetensors file); its image: --control_image")
    g.add_argument("--lllite", "--control_net_lllite_models", dest="lllite", default=None,
                   help="SDXL ControlNet-LLLite file (sdxl_train_control_net_lllite.py); needs a control image")
    g.add_argument("--lllite_mul", type=float, default=1.0, help="multiplier of the --lllite network (default 1)")
    g = p.add_argument_group("images")
    g.add_argument("--outdir", required=True, help="folder for the images")
    g.add_argument("--prompt", default=None, help="one prompt (inline options allowed)")
    g.add_argument("--from_file", default=None, help="prompt file: .txt (one a line), .toml or .json")
    g.add_argument("--images_per_prompt", type=int, default=1)
    g.add_argument("--seed", type=int, default=None, help="seed of the first image; the k-th image gets seed + k")
    g.add_argument("--steps", type=int, default=None, help="denoising steps (default 30; FLUX.1 and Chroma 20)")
    g.add_argument("--scale", type=float, default=None,
                   help="CFG scale (default 7.5; FLUX.1 and Chroma 1.0, no negative pass; Chroma about 4)")
    g.add_argument("--guidance", type=float, default=None,
                   help="FLUX.1 (dev) distilled guidance, the --g of prompts (default 3.5; Chroma has none)")
    g.add_argument("--W", type=int, default=None, help="width in pixels (default 512; SDXL 1024)")
    g.add_argument("--H", type=int, default=None, help="height in pixels (default 512; SDXL 1024)")
    g.add_argument("--sampler", default=None, choices=sampler_names(),
                   help="sampler (default ddim; FLUX.1 flow_euler)")
    g.add_argument("--batch_size", type=int, default=1, help="images denoised together")
    g.add_argument("--control_image", "--guide_image_path", dest="control_image", nargs="+", default=[],
                   metavar="PATH",
                   help="the control image(s): with --control_net / --lllite the ControlNet's image (a prompt's --cn "
                        "overrides it), else an edit model's reference image(s) (FLUX.1 Kontext) for every prompt "
                        "without its own --ci")
    g.add_argument("--grid", action="store_true", help="also write a contact sheet of all images")
    add_image_input_arguments(p)
    return p


@dataclass
class GenerateOptions:
    """What one generate run needs (from flags, or built directly by tests and benchmarks)."""

    ckpt: str
    outdir: str
    prompts: list = field(default_factory=list)  # SamplePrompt
    family: str = DEFAULT_FAMILY
    vae: Optional[str] = None
    component_files: dict = field(default_factory=dict)  # FLUX.1 --clip_l / --t5xxl / --ae
    v2: bool = False
    v_parameterization: bool = False
    clip_skip: Optional[int] = None
    dtype: torch.dtype = torch.float32
    device: Optional[str] = None
    networks: list = field(default_factory=list)  # NetworkSpec
    control_net: Optional[str] = None  # --control_net
    merge: bool = False
    embeddings: list = field(default_factory=list)  # --textual_inversion_embeddings
    images_per_prompt: int = 1
    seed: Optional[int] = None
    overrides: object = None  # PromptOverrides
    batch_size: int = 1
    grid: bool = False
    images: list = field(default_factory=list)  # PIL images of --image_path
    strength: Optional[float] = None
    masks: list = field(default_factory=list)  # PIL images of --mask_path
    regions: bool = False  # ` AND ` splits prompts into regional sub-prompts (the family has them)
    highres_fix_scale: Optional[float] = None
    highres_fix_steps: int = 28
    highres_fix_strength: Optional[float] = None
    highres_fix_latents_upscaling: bool = False


def options_from_args(a: argparse.Namespace) -> GenerateOptions:
    """Check the flags and read the prompts; ConfigError on anything wrong."""
    from library.sampling.generate import PromptOverrides
    from library.sampling.prompts import load_prompts, parse_prompt_line
    from library.sampling.samplers import canonical_sampler
    from library.train.adapters.network_apply import network_specs

    if a.sdxl and a.flux:
        raise ConfigError("--sdxl and --flux: expected at most one")
    if bool(a.prompt) == bool(a.from_file):
        raise ConfigError("expected exactly one of --prompt or --from_file")
    for name in ("images_per_prompt", "batch_size", "steps", "W", "H"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}: expected an integer >= 1, got {value}")
    if a.guidance is not None and a.guidance < 0:
        raise ConfigError(f"--guidance: expected a number >= 0, got {a.guidance}")
    if a.fp16 and a.bf16:
        raise ConfigError("--fp16 and --bf16: expected at most one")
    try:
        prompts = [parse_prompt_line(a.prompt, "--prompt")] if a.prompt else \
            load_prompts(a.from_file, check_sampler=canonical_sampler, used=("am",))
    except ConfigError as e:
        raise ConfigError(f"--from_file: {e}" if a.from_file else str(e)) from None
    for flag, paths in (("--network_weights", a.network_weights), ("--control_image", a.control_image),
                        ("--textual_inversion_embeddings", a.textual_inversion_embeddings)):
        for path in paths:
            if not os.path.isfile(path):  # now, not after the model has loaded
                raise ConfigError(f"{flag} {path}: file not found")
    family = _family(a)
    images, masks, regions = image_inputs_from_args(a, family, prompts)
    for p in prompts:
        prompt_multipliers(p, len(a.network_weights), a.merge)  # --am: checked now
    modules, weights, muls = list(a.network_module), list(a.network_weights), list(a.network_mul)
    # --control_image is the ControlNet's / LLLite's image with --control_net / an LLLite file (the first path),
    # else an edit model's reference image(s)
    guided = a.control_net is not None or a.lllite is not None or \
        LLLITE_MODULE in (modules or [_default_module(p) for p in weights])
    guide = a.control_image[0] if guided and a.control_image else None
    if a.lllite is not None:
        if not os.path.isfile(a.lllite):
            raise ConfigError(f"--lllite {a.lllite}: file not found")
        if not guide and not all(p.control_image for p in prompts):
            raise ConfigError(f"--lllite {a.lllite}: every prompt needs a control image: --control_image, or --cn in "
                              "the prompt")
        if len(muls) < len(weights):  # the --lllite multiplier goes after the other networks' (default 1) ones
            muls += [1.0] * (len(weights) - len(muls))
        modules = (modules or [_default_module(p) for p in weights]) + [LLLITE_MODULE]
        weights, muls = weights + [a.lllite], muls + [a.lllite_mul]
    if a.control_net and not os.path.exists(a.control_net):
        raise ConfigError(f"--control_net {a.control_net}: not found")
    if a.control_net and not guide and not all(p.control_image for p in prompts):
        raise ConfigError("--control_net: every prompt needs a control image: --control_image, or --cn in the prompt")
    return GenerateOptions(
        ckpt=a.ckpt, outdir=a.outdir, prompts=prompts,
        family=family, images=images, strength=a.strength, masks=masks, regions=regions, highres_fix_scale=a.highres_fix_scale,
        highres_fix_steps=a.highres_fix_steps, highres_fix_strength=a.highres_fix_strength,
        highres_fix_latents_upscaling=a.highres_fix_latents_upscaling,
        vae=a.vae, component_files=component_files(a), v2=a.v2, v_parameterization=a.v_parameterization, clip_skip=a.clip_skip,
        dtype=torch.float16 if a.fp16 else torch.bfloat16 if a.bf16 else torch.float32, device=a.device,
        networks=network_specs(modules or [_default_module(p) for p in weights], weights, muls), merge=a.merge,
        control_net=a.control_net, embeddings=list(a.textual_inversion_embeddings),
        images_per_prompt=a.images_per_prompt, seed=a.seed, batch_size=a.batch_size, grid=a.grid,
        overrides=PromptOverrides(width=a.W, height=a.H, steps=a.steps, scale=a.scale, guidance=a.guidance,
                                  sampler=a.sampler, control_images=() if guided else tuple(a.control_image),
                                  control_image=guide))


def prompt_multipliers(p, networks: int, merge: bool) -> Optional[tuple]:
    """A prompt's ` --am 0.5,1.0`: one multiplier per network, the last repeated for the rest (sd-scripts'
    gen_img); None without --am. ConfigError for a bad value, more values than networks, or --network_merge."""
    value = p.ignored.get("am")
    if value is None:
        return None
    where = f"prompt {p.prompt!r}: --am {value}"
    try:
        muls = [float(v) for v in value.split(",")]
    except ValueError:
        raise ConfigError(f"{where}: expected comma-separated numbers (one multiplier per network)") from None
    if not networks:
        raise ConfigError(f"{where}: expected --network_weights (a multiplier per network)")
    if len(muls) > networks:
        raise ConfigError(f"{where}: expected at most {networks} values (one per --network_weights)")
    if merge:
        raise ConfigError(f"{where}: per-prompt multipliers need hooked networks; drop --network_merge")
    return tuple(muls + [muls[-1]] * (networks - len(muls)))


def _default_module(path: str) -> str:
    """The --network_module a file needs when none is given: lycoris.kohya for LyCORIS modules (LoHa, LoKr, DoRA,
    OFT, IA3, ...), which networks.lora cannot build, else networks.lora."""
    from networks.lycoris_delta import is_lycoris_state

    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                keys = list(f.keys())
        except Exception:  # not readable: networks.lora says what is wrong with it
            return "networks.lora"
        if any(k.startswith("lllite_unet_") for k in keys):
            return LLLITE_MODULE
        return "lycoris.kohya" if is_lycoris_state(keys) else "networks.lora"
    return "networks.lora"


def _family(a: argparse.Namespace) -> str:
    """--sdxl / --flux, else what the model says; a Chroma file or preset is Chroma with or without --flux
    (sd-scripts' FLUX.1 scripts take Chroma with --model_type chroma)."""
    detected = detect_family(a.ckpt)
    selected = selected_family(vars(a))
    if selected is None:
        return detected or DEFAULT_FAMILY
    return detected if detected is not None and get_family(detected).variant_of == selected else selected


def load_model(o: GenerateOptions):
    """(family, components) on the device, in eval mode; ConfigError for a family that cannot generate yet."""
    from library.families import get_family
    from library.families.base import LoadOptions, ModelFamily

    try:
        family = get_family(o.family)
    except ConfigError:
        raise ConfigError(f"--{o.family}: {o.family} models are not supported yet") from None
    if type(family).generate is ModelFamily.generate:
        raise ConfigError(f"--{o.family}: image generation for {o.family} models is not implemented yet")
    device = torch.device(o.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    options = options_from_values(family.options_type, o.component_files)
    components = family.load(LoadOptions(o.ckpt, vae=o.vae, v2=o.v2, v_parameterization=o.v_parameterization,
                                         dtype=o.dtype, vae_dtype=torch.float32, family_options=options))
    for module in [components.denoiser, *components.text_encoders]:
        if module.dtype != o.dtype:  # (diffusers warns on every .to() that names a dtype)
            module.to(dtype=o.dtype)
        module.to(device).eval().requires_grad_(False)
    vae = components.vae
    if vae.dtype != torch.float32:
        vae.to(dtype=torch.float32)  # SD's VAE overflows to NaN in fp16; decoding once is cheap in fp32
    vae.to(device).eval().requires_grad_(False)
    return family, components, device


def _load_embeddings(family, components, paths: list) -> tuple:
    """--textual_inversion_embeddings into the loaded model; (token, its vectors spelled out) of multi-vector ones."""
    from library.train.adapters.textual_inversion import load_embeddings

    return load_embeddings(family, components, paths) if paths else ()


def run(o: GenerateOptions, loaded=None) -> list[str]:
    """Generate every image of `o`; returns the written paths.

    `loaded` reuses a (family, components, device) from load_model; with `o.merge` the
    networks are merged into those weights for good.
    """
    from library.sampling.generate import requests_from_prompts
    from library.sampling.img2img import attach_image_inputs
    from library.sampling.output import save_samples
    from library.train.adapters.network_apply import apply_networks

    family, components, device = loaded or load_model(o)
    family.check_loaded(components, o)  # --clip_skip against the loaded text encoder
    if not family.control_hint and (o.overrides and o.overrides.control_images or any(p.control_images for p in o.prompts)):
        raise ConfigError(f"--control_image / --ci: {family.name} models take no control images (edit models do: "
                          "FLUX.1 Kontext)")
    spelled = _load_embeddings(family, components, o.embeddings)
    applied = apply_networks(family, components, o.networks, o.merge, device, o.dtype)
    if o.control_net:  # predict adds its residuals for the requests' control images
        components.controlnet = family.create_controlnet(components, o.control_net).to(device, o.dtype).eval()
    try:
        requests = requests_from_prompts(o.prompts, o.images_per_prompt, o.seed, o.overrides, number_images=True)
        if spelled:  # a multi-vector token written in a prompt stands for all its vectors
            requests = [dataclasses.replace(r, prompt=expand_prompt(r.prompt, spelled),
                                            negative_prompt=expand_prompt(r.negative_prompt, spelled))
                        for r in requests]
        attach_image_inputs(requests, o.images, o.masks, o.strength, o.regions)
        per_image = [prompt_multipliers(p, len(o.networks), o.merge) for p in o.prompts
                     for _ in range(o.images_per_prompt)]
        generated = []
        for muls, group in _multiplier_groups(per_image, requests):
            for network, mul in zip(applied.networks, muls or [n.multiplier for n in o.networks]):
                network.set_multiplier(mul)  # a prompt's --am, else --network_mul
            generated += _generate(o, family, components, device, group, applied.networks)
    finally:
        applied.remove()
        components.controlnet = None
    networks = ", ".join(f"{os.path.basename(n.weights)}:{n.multiplier}" for n in o.networks) or None
    extra = {"model": os.path.basename(os.path.normpath(o.ckpt)), "networks": networks}
    return save_samples(generated, o.outdir, "im", None, extra=extra, grid=o.grid, always_seed=True)


def _multiplier_groups(per_image: list, requests: list) -> list:
    """Consecutive requests that share their networks' multipliers: [(multipliers or None, requests)]."""
    groups: list = []
    for muls, r in zip(per_image, requests):
        if groups and groups[-1][0] == muls:
            groups[-1][1].append(r)
        else:
            groups.append((muls, [r]))
    return groups


def _generate(o: GenerateOptions, family, components, device, requests: list, networks: list) -> list:
    """txt2img / img2img / inpainting / regions, with the highres fix when asked; `networks`: the applied ones
    (an image network such as ControlNet-LLLite gets each request's control image)."""
    from library.sampling.image_networks import generate_with_image_networks

    if o.highres_fix_scale is None:
        return generate_with_image_networks(family, components, networks, requests, clip_skip=o.clip_skip,
                                            device=device, batch_size=o.batch_size, progress=True)
    from library.sampling.img2img import DEFAULT_STRENGTH, generate_highres

    return generate_highres(
        family, components, requests, scale=o.highres_fix_scale, steps_1st=o.highres_fix_steps,
        strength_1st=o.highres_fix_strength if o.highres_fix_strength is not None else o.strength,
        strength_2nd=DEFAULT_STRENGTH if o.strength is None else o.strength,
        default_size=family.default_image_size, upscale_latents=o.highres_fix_latents_upscaling,
        clip_skip=o.clip_skip, device=device, batch_size=o.batch_size, progress=True)


def build_gen_img_parser(sdxl: bool = False) -> argparse.ArgumentParser:
    """gen_img.py / sdxl_gen_img.py: this generator's flags with sd-scripts' gen_img defaults and its other flags
    accepted (no-op) or refused when used (library/cli/gen_img.py)."""
    return as_gen_img_parser(build_parser(), sdxl)


def _main(parser: argparse.ArgumentParser, argv: Optional[list[str]], gen_img: bool = False) -> int:
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    args = parser.parse_args(argv)

    def body() -> None:
        if gen_img:
            check_gen_img_refused(args, parser)
        start = time.time()
        paths = run(options_from_args(args))
        print(f"wrote {len(paths)} image(s) to {args.outdir} in {time.time() - start:.1f}s")

    return run_tool(body)


def main(argv: Optional[list[str]] = None) -> int:
    return _main(build_parser(), argv)


def gen_img_main(argv: Optional[list[str]] = None, sdxl: bool = False) -> int:
    """gen_img.py (SD 1.x/2.x, SDXL with --sdxl) and sdxl_gen_img.py (SDXL): this generator under sd-scripts'
    flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if sdxl and "--sdxl" not in argv:
        argv.append("--sdxl")
    return _main(build_gen_img_parser(sdxl), argv, gen_img=True)


if __name__ == "__main__":
    sys.exit(main())
