"""Clean the captions and tags of a fine-tune metadata JSON with sd-scripts' rules (docs/finetune_tools.md lists them).

    python finetune/clean_captions_and_tags.py in.json out.json [--debug]

The old three-argument form `train_data_dir in_json out_json` still works (the folder is ignored).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.common import script_main  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", metavar="in_json out_json", help="metadata file to read, metadata file to write")
    p.add_argument("--debug", action="store_true", help="print every text that changed, before and after")
    return p


def run(args: argparse.Namespace) -> None:
    from finetune.common import logger, warn_list
    from library.core.errors import UserError
    from library.data.finetune_metadata import clean_metadata, load_metadata, save_metadata

    if len(args.paths) == 3:
        logger.warning("train_data_dir is no longer used: pass only in_json out_json (all entries are cleaned)")
        args.paths = args.paths[1:]
    if len(args.paths) != 2:
        raise UserError(f"expected two arguments, in_json out_json; got {len(args.paths)}: {' '.join(args.paths)}")
    in_json, out_json = args.paths
    metadata = load_metadata(in_json)
    no_tags, no_caption, changes = clean_metadata(metadata)
    warn_list("entries have no tags", no_tags)
    warn_list("entries have no caption", no_caption)
    if args.debug:
        for key, before, after in changes:
            logger.info("%s\n  FROM: %s\n  TO:   %s", key, before, after)
    save_metadata(out_json, metadata)
    logger.info("wrote %s (%d entries, %d texts changed)", out_json, len(metadata), len(changes))


def main(argv=None) -> int:
    return script_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
