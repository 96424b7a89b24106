"""Resize a LoRA to a lower rank (fixed or per module by a dynamic method), keeping ΔW of what is kept.

    python tools/resize_lora.py --model in.safetensors --save_to out.safetensors --new_rank 16
    python tools/resize_lora.py --model in.safetensors --save_to out.safetensors --new_rank 64 \
        --dynamic_method sv_fro --dynamic_param 0.9 --verbose
    python tools/resize_lora.py --model in.safetensors --save_to out.safetensors --new_rank 128 \
        --dynamic_method recipe --dynamic_param fro_ckpt=1,thr=-3.55 --base_model sd15.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.flux import add_component_file_arguments  # noqa: E402
from networks.lora_svd import DYNAMIC_METHODS  # noqa: E402
from library.core.io_utils import clean_stale_temporaries_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="LoRA to resize (kohya, diffusers/PEFT or ai-toolkit layout)")
    p.add_argument("--save_to", required=True, help="output .safetensors (kohya layout)")
    p.add_argument("--new_rank", type=int, default=4, help="rank to keep; the cap for dynamic methods (default 4)")
    p.add_argument("--new_conv_rank", type=int, default=None, help="rank for 3x3 conv modules (default: --new_rank)")
    p.add_argument("--save_precision", choices=["float", "fp16", "bf16"], default=None,
                   help="dtype of the saved tensors (default: that of the input)")
    p.add_argument("--device", default="cpu", help="where to compute, e.g. cuda")
    p.add_argument("--verbose", action="store_true", help="print each module's rank and retained Σσ / Frobenius")
    p.add_argument("--dynamic_method", choices=list(DYNAMIC_METHODS), default=None,
                   help="choose each module's rank: sv_ratio, sv_fro, sv_cumulative, or a score recipe")
    p.add_argument("--dynamic_param", default=None,
                   help="the method's parameter: a number, or for recipe e.g. fro_ckpt=1,thr=-3.55")
    p.add_argument("--base_model", default=None,
                   help="base checkpoint, needed by recipes with spn_ckpt / fro_ckpt")
    p.add_argument("--model_family", default=None,
                   help="family of --base_model (sd, sdxl, flux, ...; default: detected from the model, else sd)")
    p.add_argument("--to_lora", action="store_true",
                   help="re-factor a LyCORIS file (LoHa, LoKr, LoCon with Tucker, DoRA, OFT, IA3, full) into a plain "
                        "LoRA of --new_rank; DoRA, OFT and IA3 need --base_model")
    add_component_file_arguments(p)  # for a FLUX.1 BFL single-file --base_model
    return p


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from networks.lora_files import (
        dim_alpha_summary,
        parse_precision,
        save_lora_file,
        updated_metadata,
    )
    from networks.lora_resize import ResizeOptions, resize_comment, resize_modules
    from tools.lora_models import load_adapter_file, plain_modules

    opts = ResizeOptions(args.new_rank, args.new_conv_rank, args.dynamic_method, args.dynamic_param, args.device)
    opts.rules()  # validate the flags before any loading
    dtype = parse_precision(args.save_precision)
    lora = load_adapter_file(args.model)
    if lora.layout == "lycoris" and not args.to_lora:
        from networks.lora_files import UnsupportedLoraError
        from networks.lycoris_delta import LycorisModule

        first = next((m for m in lora.modules.values() if isinstance(m, LycorisModule)), None)
        if first is not None:
            raise UnsupportedLoraError(f"{args.model}: {first.name}: a LyCORIS {first.kind} module; give --to_lora "
                                       f"to re-factor the file into a plain LoRA of --new_rank")
    base = None
    if args.base_model:
        from library.cli.flux import component_files
        from tools.lora_models import base_weights_for, load_model

        base = base_weights_for(load_model(args.base_model, args.model_family, flags=component_files(args)),
                                lora.modules)
    modules = plain_modules(lora, base)  # --to_lora: each LyCORIS module's exact ΔW, then resized as a LoRA
    if base is not None and lora.layout == "lycoris":
        from networks.lycoris_delta import lora_module_name

        base = {lora_module_name(k): v for k, v in base.items()}  # oft_unet_x comes out as lora_unet_x
    result = resize_modules(modules, opts, base)
    if args.verbose:
        for report in result.reports:
            print(report.line())
    old_dim = lora.metadata.get("ss_network_dim") or dim_alpha_summary(modules.values())[0]
    if opts.dynamic_method:
        dim, alpha = "Dynamic", "Dynamic"
    else:
        dim, alpha = dim_alpha_summary(result.modules)
    metadata = updated_metadata(lora.metadata, dim, alpha, resize_comment(opts, old_dim))
    if lora.layout == "lycoris":
        from networks.lycoris_delta import as_lora_metadata

        metadata = as_lora_metadata(metadata)
    clean_stale_temporaries_of(args.save_to)
    save_lora_file(args.save_to, result.modules, metadata, dtype or lora.dtype)
    kept = sum(r.new_rank for r in result.reports)
    print(f"saved {args.save_to}: {len(result.modules)} modules, total rank {kept} "
          f"(was {sum(r.old_rank for r in result.reports)})")


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
