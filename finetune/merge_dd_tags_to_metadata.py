"""Merge tag files (`<image><caption_extension>`, default .txt, as the WD14 tagger writes) into a metadata JSON as "tags".

    python finetune/merge_dd_tags_to_metadata.py train_data_dir out.json [--in_json in.json] [--full_path] [--recursive]

Same rules as merge_captions_to_metadata.py: an existing out_json is updated, other fields are kept.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.common import script_main  # noqa: E402
from finetune.merge_captions_to_metadata import add_merge_args, merge  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_merge_args(p, ".txt", "tag")
    return p


def main(argv=None) -> int:
    return script_main(build_parser, lambda args: merge(args, "tags"), argv)


if __name__ == "__main__":
    sys.exit(main())
