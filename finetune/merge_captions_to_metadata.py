"""Merge caption files (`<image><caption_extension>`, default .caption) into a fine-tune metadata JSON as "caption".

    python finetune/merge_captions_to_metadata.py train_data_dir out.json [--in_json in.json] [--full_path] [--recursive]

Without --in_json an existing out_json is read and updated (so a rerun resumes); existing entries
keep their other fields, their caption is overwritten. Keys: see docs/finetune_tools.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.common import add_caption_extension, caption_extension, script_main  # noqa: E402


def add_merge_args(parser: argparse.ArgumentParser, default_ext: str, what: str) -> None:
    parser.add_argument("train_data_dir", help="folder of the training images")
    parser.add_argument("out_json", help="metadata file to write")
    parser.add_argument("--in_json", default=None, help="metadata file to read (default: out_json if it exists)")
    add_caption_extension(parser, default_ext, what)
    parser.add_argument("--full_path", action="store_true", help="key = absolute image path (several folders in one file)")
    parser.add_argument("--recursive", action="store_true", help="also read the images of every subfolder")
    parser.add_argument("--debug", action="store_true", help="print every key and its text")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_merge_args(p, ".caption", "caption")
    return p


def merge(args: argparse.Namespace, field: str) -> None:
    from finetune.common import logger, progress, warn_list
    from library.core.errors import UserError
    from library.data.finetune_metadata import (
        check_unique_keys,
        image_key,
        list_dataset_images,
        load_or_new,
        merge_text_files,
        save_metadata,
    )

    images = list_dataset_images(args.train_data_dir, args.recursive)
    if not images:
        raise UserError(f"train_data_dir: no images in {args.train_data_dir}" + ("" if args.recursive else " (subfolders need --recursive)"))
    logger.info("found %d images", len(images))
    check_unique_keys(images, args.train_data_dir, args.full_path)
    metadata = load_or_new(args.out_json, args.in_json)
    ext = caption_extension(args)
    written, missing = merge_text_files(metadata, images, args.train_data_dir, field, ext, args.full_path,
                                        progress=lambda xs: progress(xs, f"merging {field}"))
    warn_list(f"images have no (or an empty) {ext} file and were left out", missing)
    if args.debug:
        for path in images:
            key = image_key(path, args.train_data_dir, args.full_path)
            if field in metadata.get(key, {}):
                logger.info("%s: %s", key, metadata[key][field])
    save_metadata(args.out_json, metadata)
    logger.info("wrote %s (%d %s merged, %d entries)", args.out_json, written, field, len(metadata))


def main(argv=None) -> int:
    return script_main(build_parser, lambda args: merge(args, "caption"), argv)


if __name__ == "__main__":
    sys.exit(main())
