"""Merge LoRAs into a base checkpoint, or into one new LoRA (exact with --concat, or re-factored to --new_rank).

    python tools/merge_lora.py --sd_model base.safetensors --save_to merged.safetensors \
        --models a.safetensors b.safetensors --ratios 1.0 0.5 --save_precision fp16
    python tools/merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors --ratios 1 0.5 --concat
    python tools/merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors --new_rank 32
    python tools/merge_lora.py --model_family flux --sd_model flux1-dev.safetensors --clip_l clip_l.safetensors \
        --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors --save_to merged.safetensors --models flux_lora.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.flux import add_component_file_arguments  # noqa: E402
from library.core.errors import ConfigError  # noqa: E402
from library.core.io_utils import clean_stale_temporaries_of  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sd_model", default=None,
                   help="base checkpoint (file or diffusers folder) to merge into; omit to merge LoRAs into a LoRA")
    p.add_argument("--save_to", required=True,
                   help="output: a .safetensors/.ckpt file, a folder (diffusers layout) for --sd_model, or a LoRA")
    p.add_argument("--models", nargs="+", required=True, help="LoRA files to merge")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="one multiplier per model (default 1.0)")
    p.add_argument("--save_precision", choices=["float", "fp16", "bf16"], default=None,
                   help="dtype of the output (default: float for a checkpoint, the inputs' for a LoRA)")
    p.add_argument("--precision", choices=["float", "fp16", "bf16"], default="float",
                   help="accepted for sd-scripts compatibility; merging always computes in float32")
    p.add_argument("--concat", action="store_true", help="LoRA+LoRA: stack the ranks, exact")
    p.add_argument("--new_rank", type=int, default=None, help="LoRA+LoRA: re-factor the sum to this rank by SVD")
    p.add_argument("--new_conv_rank", type=int, default=None, help="rank for 3x3 conv modules with --new_rank")
    p.add_argument("--device", default="cpu", help="where to compute")
    p.add_argument("--model_family", default=None,
                   help="family of --sd_model (sd, sdxl, flux, ...; default: detected from the model, else sd)")
    add_component_file_arguments(p)  # a FLUX.1 BFL single file holds only the transformer
    return p


def merge_lora_files(models, ratios, save_to, concat, new_rank, new_conv_rank, dtype, device, lbws=None) -> None:
    """LoRA + LoRA: the shared code of merge_lora.py and svd_merge_lora.py.

    `lbws`: one LoRA Block Weight list per model (svd_merge_lora's --lbws), multiplied into its ratio per block.
    """
    from networks.lora_block_weights import check_lbws, module_block_weights
    from networks.lora_files import dim_alpha_summary, save_lora_file, updated_metadata
    from networks.lora_merge import WeightedLora, check_ratios, concat_merge, svd_merge
    from tools.lora_models import load_adapter_file, plain_modules

    ratios = check_ratios(models, ratios)
    lbws = check_lbws(lbws, models)
    files = [load_adapter_file(m) for m in models]  # all read and checked before any SVD
    plain = [plain_modules(f) for f in files]  # LyCORIS modules: their exact ΔW as factors
    loras = [WeightedLora(p, r, f.path, module_block_weights(w, p, f.path) if w else None)
             for f, p, r, w in zip(files, plain, ratios, lbws)]
    if concat:
        modules, how = concat_merge(loras), "concatenated ranks"
    else:
        modules, how = svd_merge(loras, new_rank, new_conv_rank, device), f"SVD to rank {new_rank}"
    if not modules:
        raise ConfigError("--lbws: every block of every model is weighted 0; nothing to merge")
    dim, alpha = dim_alpha_summary(modules, integer_alpha=True)  # as sd-scripts' svd_merge_lora: "6"
    names = ", ".join(f"{os.path.basename(m)}x{r:g}" + (f" lbw [{','.join(f'{v:g}' for v in w)}]" if w else "")
                      for m, r, w in zip(models, ratios, lbws))
    metadata = updated_metadata(files[0].metadata, dim, alpha, f"merged ({how}): {names}")
    if any(f.layout == "lycoris" for f in files):
        from networks.lycoris_delta import as_lora_metadata

        metadata = as_lora_metadata(metadata)
    clean_stale_temporaries_of(save_to)
    save_lora_file(save_to, modules, metadata, dtype or files[0].dtype)
    print(f"saved {save_to}: {len(modules)} modules, rank {dim}")


def run(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from networks.lora_files import parse_precision

    dtype = parse_precision(args.save_precision)
    if args.sd_model is None:
        if not args.concat and args.new_rank is None:
            raise ConfigError("without --sd_model, give --concat (exact) or --new_rank R (SVD) to merge LoRAs "
                              "into a LoRA")
        merge_lora_files(args.models, args.ratios, args.save_to, args.concat, args.new_rank, args.new_conv_rank,
                         dtype, args.device)
        return
    from library.cli.flux import component_files
    from networks.lora_merge import WeightedLora, check_ratios, merge_into_layers
    from tools.lora_models import in_family_names, load_adapter_file, load_model, lora_layers, save_model

    ratios = check_ratios(args.models, args.ratios)
    files = [load_adapter_file(m) for m in args.models]  # LoRA or LyCORIS (LoHa, LoKr, DoRA, OFT, IA3, ...)
    model = load_model(args.sd_model, args.model_family, flags=component_files(args))
    loras = [WeightedLora(in_family_names(model, f.modules), r, m) for f, m, r in zip(files, args.models, ratios)]
    merged = merge_into_layers(lora_layers(model), loras)
    save_model(model, args.save_to, dtype)
    print(f"saved {args.save_to}: {merged} LoRA modules merged into {args.sd_model}")


def main(argv=None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
