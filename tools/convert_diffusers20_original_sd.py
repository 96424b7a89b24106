"""Convert a model between a diffusers folder and one original-layout file (sd-scripts' tools/convert_diffusers20_original_sd.py).

    python tools/convert_diffusers20_original_sd.py model.safetensors out_folder [--use_safetensors]
    python tools/convert_diffusers20_original_sd.py model_folder model.safetensors [--fp16 | --bf16 | --float]

A `model_to_save` with an extension (.safetensors, .ckpt) is written as one file in the family's original
layout (SD 1.x/2.x LDM, SDXL SGM, ...), otherwise as a diffusers folder (`.safetensors` weights with
--use_safetensors, else `.bin`). SD 1.x/2.x and SDXL are detected from the model (keys or model_index.json);
other families that have both layouts take --model_family. The conversion is the families' own loader and
writer (the key tables in library/families/*/layout.py): no key table of its own.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--v1", action="store_true", help="the model is SD 1.x (checked; detected when neither is given)")
    p.add_argument("--v2", action="store_true", help="the model is SD 2.x (checked; detected when neither is given)")
    p.add_argument("--unet_use_linear_projection", action="store_true",
                   help="SD 2.x diffusers UNet with use_linear_projection=true (always so here; see docs/tools.md)")
    p.add_argument("--fp16", action="store_true", help="load as fp16 and save as fp16")
    p.add_argument("--bf16", action="store_true", help="save as bf16")
    p.add_argument("--float", action="store_true", help="save as float32")
    p.add_argument("--save_precision_as", type=str, default="no", choices=["fp16", "bf16", "float", "no"],
                   help="save precision; not together with --fp16 / --bf16 / --float")
    p.add_argument("--epoch", type=int, default=0, help="epoch written into a .ckpt")
    p.add_argument("--global_step", type=int, default=0, help="global_step written into a .ckpt")
    p.add_argument("--metadata", type=str, default=None,
                   help="metadata of a .safetensors file as a Python dict literal: '{\"name\": \"model\"}'")
    p.add_argument("--variant", type=str, default=None, help="diffusers variant to load (not supported)")
    p.add_argument("--reference_model", type=str, default=None,
                   help="diffusers model to copy the scheduler / tokenizer config from (not supported)")
    p.add_argument("--use_safetensors", action="store_true", help="diffusers folder weights as .safetensors")
    p.add_argument("--model_family", type=str, default=None,
                   help="the model family (ours; default: detected, sd when nothing tells)")
    p.add_argument("--v_parameterization", action="store_true",
                   help="(ours) an SD 2.x v-prediction model: the folder's scheduler predicts v")
    p.add_argument("model_to_load", type=str, help="a single file or a diffusers folder")
    p.add_argument("model_to_save", type=str,
                   help="a file (with an extension) or a diffusers folder (without one)")
    return p


def _save_dtype(args):
    import torch

    from library.core.errors import UserError

    chosen = [name for name, on in (("fp16", args.fp16), ("bf16", args.bf16), ("float", args.float)) if on]
    if len(chosen) > 1:
        raise UserError(f"--{chosen[0]} and --{chosen[1]}: give one save precision")
    if chosen and args.save_precision_as != "no" and args.save_precision_as != chosen[0]:
        raise UserError(f"--save_precision_as {args.save_precision_as}: conflicts with --{chosen[0]}")
    name = chosen[0] if chosen else args.save_precision_as
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}.get(name)


def _metadata(text):
    from library.core.errors import UserError

    if text is None:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, dict):
        raise UserError(f"--metadata: expected a Python dict literal like '{{\"name\": \"model\"}}', got {text!r}")
    return {str(k): str(v) for k, v in value.items()}


def _check(args) -> dict:
    """Everything the flags and paths say, checked before loading (one-line UserErrors)."""
    from library.core.errors import UserError
    from library.families import DEFAULT_FAMILY, family_names
    from library.families.detect import detect_family

    src, dst = args.model_to_load, args.model_to_save
    if not os.path.exists(src):
        raise UserError(f"model_to_load: {src}: no such file or folder")
    if args.v1 and args.v2:
        raise UserError("--v1 and --v2: give one (or neither: the version is read from the model)")
    if args.variant is not None:
        raise UserError(f"--variant {args.variant}: not supported; convert the folder's default weights")
    if args.reference_model is not None:
        raise UserError("--reference_model: not supported; the written folder's scheduler and tokenizer are the "
                        "model's own (see docs/tools.md)")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UserError(f"model_to_save: {dst} is the model to load; write to a new path")
    save_file = bool(os.path.splitext(dst)[1])
    ext = os.path.splitext(dst)[1].lower()
    if save_file and ext not in (".safetensors", ".ckpt"):
        raise UserError(f"model_to_save: {dst}: expected .safetensors or .ckpt (or no extension: a diffusers folder)")
    if os.path.isfile(dst) and not save_file:
        raise UserError(f"model_to_save: {dst} is a file; a diffusers folder needs a new path")
    metadata = _metadata(args.metadata)
    if metadata is not None and ext != ".safetensors":
        raise UserError("--metadata: only a .safetensors file carries metadata")
    family = args.model_family or detect_family(src) or DEFAULT_FAMILY
    if family not in family_names():
        raise UserError(f"--model_family {family}: expected one of {', '.join(family_names())}")
    if family != DEFAULT_FAMILY and (args.v1 or args.v2):  # the default family is sd-scripts' SD 1.x / 2.x
        raise UserError(f"--v1 / --v2: for SD 1.x / 2.x models; {src} is {family}")
    if save_file:
        fmt = "safetensors" if ext == ".safetensors" else "ckpt"
    else:
        fmt = "diffusers_safetensors" if args.use_safetensors else "diffusers"
    return {"family": family, "fmt": fmt, "save_dtype": _save_dtype(args), "metadata": metadata}


def convert(args) -> str:
    import torch

    from library.core.errors import UserError
    from library.core.io_utils import clean_stale_temporaries_of
    from library.families import DEFAULT_FAMILY, get_family
    from library.families.base import LoadOptions

    plan = _check(args)
    family = get_family(plan["family"])
    load_dtype = torch.float16 if args.fp16 else torch.float32
    print(f"loading {args.model_to_load} ({family.name})")
    components = family.load(LoadOptions(args.model_to_load, v2=args.v2, v_parameterization=args.v_parameterization,
                                         dtype=load_dtype, vae_dtype=load_dtype))
    if family.name == DEFAULT_FAMILY and (args.v1 or args.v2) and bool(components.v2) != args.v2:
        found = "2.x" if components.v2 else "1.x"
        raise UserError(f"--{'v2' if args.v2 else 'v1'}: {args.model_to_load} is an SD {found} model")
    clean_stale_temporaries_of(args.model_to_save)
    try:
        written = family.save_model(components, args.model_to_save, plan["fmt"], plan["save_dtype"], plan["metadata"],
                                    epoch=args.epoch, global_step=args.global_step)
    except NotImplementedError as e:
        raise UserError(str(e)) from None
    print(f"saved {written} ({plan['fmt']})")
    return written


def run(argv=None) -> None:
    convert(setup_parser().parse_args(argv))


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
