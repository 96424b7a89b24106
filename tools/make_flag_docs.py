"""Print the flag tables of a training script's parser as Markdown (pasted into docs/<script>.md).

    python tools/make_flag_docs.py --family sd > /tmp/flags.md
    python tools/make_flag_docs.py --family sd --fine_tune   # fine_tune.py's flags (docs/fine_tune.md)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.entry import build_parser  # noqa: E402
from library.families import DEFAULT_FAMILY, get_family  # noqa: E402


def flag_tables(parser: argparse.ArgumentParser) -> str:
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        out.append(f"### {group.title}\n\n| flag | default | meaning |\n|---|---|---|")
        for a in actions:
            flag = max(a.option_strings, key=len)
            if a.choices:
                flag += " {" + ",".join(str(c) for c in a.choices) + "}"
            default = "" if a.default in (None, False, argparse.SUPPRESS) else f"`{a.default}`"
            text = (a.help or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{flag}` | {default} | {text} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--family", default=DEFAULT_FAMILY)
    p.add_argument("--fine_tune", action="store_true", help="the fine-tune script's parser")
    a = p.parse_args()
    print(flag_tables(build_parser("", get_family(a.family), a.fine_tune)))


if __name__ == "__main__":
    main()
