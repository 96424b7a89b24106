"""Assign every image to its aspect-ratio bucket, write `train_resolution` into the metadata and cache its latents.

    python finetune/prepare_buckets_latents.py train_data_dir in.json out.json MODEL \\
        [--max_resolution 512,512] [--min_bucket_reso 256] [--max_bucket_reso 1024] [--bucket_reso_steps 64] \\
        [--bucket_no_upscale] [--flip_aug] [--alpha_mask] [--mixed_precision no|fp16|bf16] [--sdxl | --flux]

The buckets and the latent files are the trainer's own (library/data/buckets.py, latent_caching.py):
a training run with `--in_json out.json --train_data_dir train_data_dir --pretrained_model_name_or_path MODEL
--resolution W,H --enable_bucket --cache_latents --cache_latents_to_disk` and the same bucket, flip, alpha-mask
and precision flags finds every `<image>_<WWWW>x<HHHH>_<arch>.npz` valid and encodes nothing. Valid cache
files are always kept, so a rerun resumes where an interrupted one stopped (--skip_existing is implied).
Flags this script does not know are passed to the training parser (e.g. --vae, or Flux's --ae / --clip_l).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.common import logger, setup_logging  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("train_data_dir", help="folder of the training images")
    p.add_argument("in_json", help="metadata file to read")
    p.add_argument("out_json", help="metadata file to write")
    p.add_argument("model_name_or_path", help="model whose VAE encodes the latents (same value as the training run's)")
    p.add_argument("--v2", action="store_true", help="SD 2.x model (as the training flag)")
    p.add_argument("--batch_size", type=int, default=1, help="images per VAE batch")
    p.add_argument("--max_data_loader_n_workers", type=int, default=None, help="image decoding workers (default: main process)")
    p.add_argument("--max_resolution", default="512,512", help="training resolution 'width,height' (the bucket area)")
    p.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side")
    p.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side")
    p.add_argument("--bucket_reso_steps", type=int, default=64, help="bucket sides are multiples of this")
    p.add_argument("--bucket_no_upscale", action="store_true", help="one bucket per image size, never enlarging")
    p.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"], help="dtype of the VAE (as the training flag)")
    p.add_argument("--full_path", action="store_true", help="key = absolute image path (as the merge scripts' flag)")
    p.add_argument("--flip_aug", action="store_true", help="also cache the latents of the flipped image")
    p.add_argument("--alpha_mask", action="store_true", help="also cache the alpha channel as the loss mask")
    p.add_argument("--recursive", action="store_true", help="also read the images of every subfolder")
    p.add_argument("--skip_existing", action="store_true", help="accepted for sd-scripts compatibility: valid cache files are always kept")
    family = p.add_mutually_exclusive_group()
    family.add_argument("--sdxl", action="store_true", help="SDXL model (latents *_sdxl.npz)")
    family.add_argument("--flux", action="store_true", help="FLUX.1 model (latents *_flux.npz)")
    return p


def _training_flags(args: argparse.Namespace, metadata_path: str, output_dir: str, extra: list[str]) -> list[str]:
    flags = [
        "--pretrained_model_name_or_path", args.model_name_or_path,
        "--in_json", metadata_path, "--train_data_dir", args.train_data_dir,
        "--resolution", args.max_resolution, "--enable_bucket",
        "--min_bucket_reso", str(args.min_bucket_reso), "--max_bucket_reso", str(args.max_bucket_reso),
        "--bucket_reso_steps", str(args.bucket_reso_steps),
        "--cache_latents", "--cache_latents_to_disk", "--vae_batch_size", str(args.batch_size),
        "--max_data_loader_n_workers", str(args.max_data_loader_n_workers or 0),
        "--mixed_precision", args.mixed_precision, "--output_dir", output_dir,
    ]
    for name in ("bucket_no_upscale", "flip_aug", "alpha_mask", "v2"):
        if getattr(args, name):
            flags.append("--" + name)
    return flags + extra


def run(args: argparse.Namespace, extra: list[str]) -> None:
    from library.cli.cache_tools import build_trainer
    from library.core.errors import UserError
    from finetune.common import progress, warn_list
    from library.data.finetune_metadata import (
        check_unique_keys,
        image_key,
        list_dataset_images,
        load_metadata,
        save_metadata,
    )
    from library.data.image_scan import read_image_size
    from library.families import DEFAULT_FAMILY, get_family, selected_family

    if len(args.max_resolution.split(",")) != 2:
        raise UserError(f"--max_resolution: expected 'width,height', got {args.max_resolution!r}")
    images = list_dataset_images(args.train_data_dir, args.recursive)
    if not images:
        raise UserError(f"train_data_dir: no images in {args.train_data_dir}" + ("" if args.recursive else " (subfolders need --recursive)"))
    check_unique_keys(images, args.train_data_dir, args.full_path)
    metadata = load_metadata(args.in_json)
    logger.info("found %d images; %d entries in %s", len(images), len(metadata), args.in_json)
    readable, unreadable = [], []
    for path in progress(images, "reading image headers"):
        try:
            read_image_size(path)
            readable.append(path)
        except Exception as e:  # damaged files are left out (as sd-scripts), not fatal for the folder
            unreadable.append(f"{path} ({e})")
    images = readable
    warn_list("images could not be read and are left out", unreadable)
    if not images:
        raise UserError(f"train_data_dir: no readable images in {args.train_data_dir}")
    family = get_family(selected_family(vars(args)) or DEFAULT_FAMILY)

    with tempfile.TemporaryDirectory(prefix="prepare_buckets_") as tmp:
        # The trainer reads every image of the folder (entries without a caption too: the caption
        # does not change a latent), keyed by absolute path so each resolves to its own file.
        listing = os.path.join(tmp, "images.json")
        save_metadata(listing, {os.path.abspath(p): {"caption": "-"} for p in images})
        trainer = build_trainer(family, _training_flags(args, listing, tmp, extra), "prepare_buckets_latents")
        trainer.cache_latents_only()
        plan = trainer.data

    buckets: dict[str, tuple[int, int]] = {}
    for group in plan.groups:
        if group.validation:
            continue
        for sid, place in group.placements.items():
            buckets.setdefault(os.path.abspath(plan.samples[sid].path), place.bucket)
    counts: dict[tuple[int, int], int] = {}
    failed = {os.path.abspath(p) for p in plan.bad_paths}
    for path in images:
        bucket = buckets.get(os.path.abspath(path))
        if bucket is None or os.path.abspath(path) in failed:
            continue
        metadata.setdefault(image_key(path, args.train_data_dir, args.full_path), {})["train_resolution"] = list(bucket)
        counts[bucket] = counts.get(bucket, 0) + 1
    for i, (bucket, n) in enumerate(sorted(counts.items())):
        logger.info("bucket %d %s: %d", i, bucket, n)
    if failed:
        logger.warning("%d images could not be read and have no train_resolution: %s", len(failed), ", ".join(sorted(failed)[:5]))
    save_metadata(args.out_json, metadata)
    logger.info("wrote %s (%d entries)", args.out_json, len(metadata))


def main(argv=None) -> int:
    from library.core.errors import run_tool

    setup_logging()
    args, extra = build_parser().parse_known_args(argv)
    return run_tool(run, args, extra)


if __name__ == "__main__":
    sys.exit(main())
