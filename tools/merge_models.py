"""Weighted merge of N full models, key by key (sd-scripts' tools/merge_models.py).

    python tools/merge_models.py --models a.safetensors b.safetensors --ratios 0.7 0.3 --output merged.safetensors \\
        [--unet_only] [--precision float] [--saving_precision fp16] [--device cpu] [--show_skipped]

Every key of the first model becomes Σ ratio_i · model_i[key] (ratios default to 1/N each), computed in
--precision and saved in --saving_precision. As sd-scripts: a key another model lacks takes the first model's
value for that model's share; keys only in later models are skipped (--show_skipped names them); with
--unet_only the VAE and text encoder keys (`first_stage_model.`, `cond_stage_model.`, `conditioner.`) are the
first model's; SD 1.x text encoder keys without `text_model.` are matched to those with it; `.safetensors` is
appended to an --output without it.

Streaming: the files are read through safetensors' memory map one key at a time, so memory holds the merged
output plus the tensors of one key, never a whole input model. Before anything is computed, every file is
checked (readable, its shapes equal to the first model's for shared keys), with a one-line error otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRECISIONS = ("float", "fp16", "bf16")
TEXT_ENCODER_KEY_REPLACEMENTS = [
    ("cond_stage_model.transformer.embeddings.", "cond_stage_model.transformer.text_model.embeddings."),
    ("cond_stage_model.transformer.encoder.", "cond_stage_model.transformer.text_model.encoder."),
    ("cond_stage_model.transformer.final_layer_norm.", "cond_stage_model.transformer.text_model.final_layer_norm."),
]


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", type=str, required=True, help="models to merge (.safetensors)")
    p.add_argument("--output", type=str, required=True, help="output model (.safetensors is appended if missing)")
    p.add_argument("--ratios", nargs="+", type=float, help="ratio of each model (default: 1/N each)")
    p.add_argument("--unet_only", action="store_true", help="merge only the UNet; VAE and text encoders: the first model's")
    p.add_argument("--device", type=str, default="cpu", help="device for the arithmetic (default cpu)")
    p.add_argument("--precision", type=str, default="float", choices=PRECISIONS, help="calculation precision")
    p.add_argument("--saving_precision", type=str, default="float", choices=PRECISIONS, help="saving precision")
    p.add_argument("--show_skipped", action="store_true", help="show keys skipped because the first model lacks them")
    return p


def is_unet_key(key: str) -> bool:
    """Not a VAE or text encoder key (sd-scripts' test; `conditioner.` is SDXL's text encoders)."""
    return not ("first_stage_model" in key or "cond_stage_model" in key or "conditioner." in key)


def canonical_key(key: str) -> str:
    """SD 1.x text encoder keys without `text_model.` as those with it (sd-scripts' replace_text_encoder_key)."""
    for old, new in TEXT_ENCODER_KEY_REPLACEMENTS:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _dtype(name: str):
    import torch

    return {"float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _check(args) -> tuple[list[float], str]:
    """Ratios and the output path; a one-line UserError for a bad flag or file, before any work."""
    from library.core.errors import UserError

    for model in args.models:
        if not model.endswith(".safetensors"):
            raise UserError(f"--models: {model}: expected a .safetensors file")
        if not os.path.isfile(model):
            raise UserError(f"--models: {model}: file not found")
    ratios = args.ratios if args.ratios is not None else [1.0 / len(args.models)] * len(args.models)
    if len(ratios) != len(args.models):
        raise UserError(f"--ratios: expected one ratio per model ({len(args.models)}), got {len(ratios)}")
    bad = next((r for r in ratios if not math.isfinite(r)), None)
    if bad is not None:
        raise UserError(f"--ratios: expected finite numbers, got {bad}")
    output = args.output if args.output.endswith(".safetensors") else args.output + ".safetensors"
    if any(os.path.abspath(output) == os.path.abspath(m) for m in args.models):
        raise UserError(f"--output: {output} is one of the --models; write the merge to a new file")
    return ratios, output


def _headers(models: list[str]) -> list[dict[str, tuple[str, tuple[int, ...]]]]:
    """{canonical key: (file key, shape)} of each model, from the headers only."""
    from safetensors import safe_open

    from library.core.errors import UserError

    out = []
    for model in models:
        try:
            with safe_open(model, framework="pt") as f:
                out.append({canonical_key(k): (k, tuple(f.get_slice(k).get_shape())) for k in f.keys()})
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise UserError(f"--models: {model}: not a readable safetensors file ({str(e).splitlines()[0]})") \
                from None
    first = out[0]
    for model, header in zip(models[1:], out[1:]):
        for key, (_, shape) in header.items():
            if key in first and first[key][1] != shape:
                raise UserError(f"--models: {model}: {key} has shape {list(shape)}, the first model "
                                f"{list(first[key][1])}; models of different architectures cannot be merged")
    return out


def merge_models(models: list[str], ratios: list[float], output: str, unet_only: bool = False,
                 precision: str = "float", saving_precision: str = "float", device: str = "cpu",
                 show_skipped: bool = False, log=print) -> dict[str, int]:
    """Write the merge; returns counts {"merged", "first_model_only", "partial", "skipped"}."""
    import contextlib

    from safetensors import safe_open
    from tqdm import tqdm

    from library.core.io_utils import save_safetensors_atomic

    headers = _headers(models)
    dtype, save_dtype = _dtype(precision), _dtype(saving_precision)
    counts = {"merged": 0, "first_model_only": 0, "partial": 0, "skipped": 0}
    for model, header in zip(models[1:], headers[1:]):
        skipped = [k for k in header if k not in headers[0]]
        counts["skipped"] += len(skipped)
        if show_skipped:
            for key in skipped:
                log(f"Skip: {key} (in {model}, not in the first model)")
    merged = {}
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(m, framework="pt", device=device)) for m in models]
        for key, (file_key, _) in tqdm(headers[0].items(), desc="merging", unit="key"):
            first = files[0].get_tensor(file_key)
            if (unet_only and not is_unet_key(key)) or not first.is_floating_point():
                # the first model's value as is (integer buffers such as position_ids are not averaged)
                merged[key] = first.to(save_dtype) if first.is_floating_point() else first
                counts["first_model_only"] += 1
                continue
            total = first.to(dtype) * ratios[0]
            missing = []
            for model, f, header, ratio in zip(models[1:], files[1:], headers[1:], ratios[1:]):
                if key in header:
                    total += f.get_tensor(header[key][0]).to(dtype) * ratio
                else:  # sd-scripts: the first model's value stands in for this model's share
                    total += first.to(dtype) * ratio
                    missing.append(model)
            if missing:
                counts["partial"] += 1
                log(f"Key {key} not in {', '.join(missing)}; the first model's value is used for their ratio")
            merged[key] = total.to("cpu", save_dtype)
            counts["merged"] += 1
            del first, total
    save_safetensors_atomic(merged, output, metadata={"format": "pt"})
    return counts


def run(argv=None) -> None:
    args = setup_parser().parse_args(argv)
    ratios, output = _check(args)
    counts = merge_models(args.models, ratios, output, args.unet_only, args.precision, args.saving_precision,
                          args.device, args.show_skipped)
    print(f"saved {output}: {counts['merged']} keys merged, {counts['first_model_only']} from the first model, "
          f"{counts['partial']} missing in some models, {counts['skipped']} skipped")


def main(argv: Optional[list[str]] = None) -> int:
    from library.core.errors import run_tool

    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
