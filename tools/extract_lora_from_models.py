"""Extract a LoRA from the difference of two checkpoints (tuned − original) by low-rank SVD.

    python tools/extract_lora_from_models.py --model_org base.safetensors --model_tuned tuned.safetensors \
        --save_to extracted.safetensors --dim 32 --conv_dim 16 --save_precision fp16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.flux import add_component_file_arguments  # noqa: E402
from library.core.io_utils import clean_stale_temporaries_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_org", required=True, help="original model (file, diffusers folder or preset)")
    p.add_argument("--model_tuned", required=True, help="fine-tuned model of the same architecture")
    p.add_argument("--save_to", required=True, help="output LoRA .safetensors")
    p.add_argument("--dim", type=int, default=4, help="rank of Linear / 1x1 modules (default 4)")
    p.add_argument("--conv_dim", type=int, default=None, help="rank of 3x3 convs; unset: no conv modules")
    p.add_argument("--clamp_quantile", type=float, default=0.99, help="clamp factors at this quantile (default 0.99)")
    p.add_argument("--min_diff", type=float, default=0.01,
                   help="include the text encoder only if some weight differs by more than this (default 0.01)")
    p.add_argument("--save_precision", choices=["float", "fp16", "bf16"], default=None,
                   help="dtype of the saved tensors (default float)")
    p.add_argument("--device", default="cpu", help="where to compute the SVDs")
    p.add_argument("--svd", choices=["auto", "full", "randomized"], default="auto",
                   help="auto: randomized SVD where the rank is small against the layer, else full")
    p.add_argument("--v2", action="store_true", help="accepted for sd-scripts compatibility (detected from the model)")
    p.add_argument("--sdxl", action="store_true", help="the models are SDXL (sd-scripts' flag; same as --model_family sdxl)")
    p.add_argument("--model_family", default=None,
                   help="family of both models (sd, sdxl, flux, ...; default: detected from the model, else sd)")
    p.add_argument("--no_metadata", action="store_true", help="write only the minimal ss_* keys")
    add_component_file_arguments(p)  # a FLUX.1 BFL single file holds only the transformer
    return p


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from library.cli.flux import component_files
    from networks.lora_extract import (
        ExtractOptions,
        extract_lora,
        text_encoder_included,
    )
    from networks.lora_files import dim_alpha_summary, parse_precision, save_lora_file
    from library.families import selected_family
    from library.families.detect import detect_family
    from tools.lora_models import load_model, lora_layers

    opts = ExtractOptions(args.dim, args.conv_dim, args.clamp_quantile, args.min_diff, args.device, args.svd)
    opts.check()
    dtype = parse_precision(args.save_precision)
    include_conv = args.conv_dim is not None
    family = args.model_family or selected_family(vars(args)) or detect_family(args.model_org)
    org = load_model(args.model_org, family, flags=component_files(args))
    tuned = load_model(args.model_tuned, family, flags=component_files(args))
    org_layers = lora_layers(org, include_conv, file_only=False)  # the modules networks.lora trains, as sd-scripts
    modules = extract_lora(org_layers, lora_layers(tuned, include_conv, file_only=False), opts)
    if not text_encoder_included(modules, org_layers):
        print(f"text encoder is the same (no weight differs by more than {args.min_diff}): not extracted")
    dim, alpha = dim_alpha_summary(modules)
    network_args = {"conv_dim": str(args.conv_dim), "conv_alpha": str(args.conv_dim)} if include_conv else {}
    metadata = {
        "ss_v2": str(org.components.v2),
        "ss_base_model_version": org.family.base_model_version(org.components),
        "ss_network_module": org.family.lora_network_module,  # FLUX.1: networks.lora_flux, as sd-scripts
        "ss_network_dim": dim,
        "ss_network_alpha": alpha,
        "ss_network_args": json.dumps(network_args),
    }
    if not args.no_metadata:
        metadata["ss_training_comment"] = (f"extracted from {os.path.basename(args.model_tuned)} - "
                                           f"{os.path.basename(args.model_org)}, dim {args.dim}, "
                                           f"conv_dim {args.conv_dim}, clamp_quantile {args.clamp_quantile}")
    clean_stale_temporaries_of(args.save_to)
    save_lora_file(args.save_to, modules, metadata, dtype or None)
    print(f"saved {args.save_to}: {len(modules)} modules")


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
