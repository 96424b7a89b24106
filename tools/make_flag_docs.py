"""Print (or write into a docs page) the flag tables of a training script, made from the flags' declarations.

    python tools/make_flag_docs.py --family sd                       # train_network.py's flags, as Markdown
    python tools/make_flag_docs.py --family sd --fine_tune           # fine_tune.py's flags (docs/fine_tune.md)
    python tools/make_flag_docs.py --family sd --write docs/train_network.md   # replace the page's tables
    python tools/make_flag_docs.py --textual_inversion --write docs/textual_inversion.md  # its own flags only

--write replaces what stands between the page's `<!-- flag tables -->` and `<!-- end of flag tables -->` lines
(tests/test_docs.py checks that the pages hold exactly what this prints).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.cli.describe import describe  # noqa: E402
from library.cli.parser import training_flags  # noqa: E402
from library.core.io_utils import atomic_write_text  # noqa: E402
from library.families import DEFAULT_FAMILY, get_family  # noqa: E402

BEGIN = "<!-- flag tables -->"
END = "<!-- end of flag tables -->"


def flag_tables(description: dict) -> str:
    """One Markdown table per group of a --describe_flags document: flag (choices, other names), default, help."""
    out = []
    for group in description["groups"]:
        out.append(f"### {group}\n\n| flag | default | meaning |\n|---|---|---|")
        for flag in (f for f in description["flags"] if f["group"] == group):
            name = f"--{flag['name']}"
            if flag["choices"]:
                name += " {" + ",".join(str(c) for c in flag["choices"]) + "}"
            cell = ", ".join([f"`{name}`", *(f"`--{a}`" for a in flag["aliases"])])
            default = "" if flag["default"] is None or flag["default"] is False else f"`{flag['default']}`"
            text = flag["help"].replace("|", "\\|").replace("\n", " ")
            out.append(f"| {cell} | {default} | {text} |")
        out.append("")
    return "\n".join(out)


def tables_for(family: str, fine_tune: bool, textual_inversion: bool = False) -> str:
    """The tables of a script's flags; textual inversion: only its own group (the others are train_network.md's,
    less the network's)."""
    if textual_inversion:
        specs = [s for s in training_flags(get_family(family), textual_inversion=True) if s.group == "textual inversion"]
        return flag_tables(describe(specs, mode="textual_inversion"))
    return flag_tables(describe(training_flags(get_family(family), fine_tune), fine_tune=fine_tune))


def replace_tables(page_text: str, tables: str, page: str = "page") -> str:
    """`page_text` with the part between the BEGIN and END lines replaced by `tables`."""
    if BEGIN not in page_text or END not in page_text:
        raise SystemExit(f"error: {page}: expected the lines {BEGIN} and {END} around the flag tables")
    head, rest = page_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{tables}\n{END}{tail}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--family", default=DEFAULT_FAMILY)
    p.add_argument("--fine_tune", action="store_true", help="the fine-tune script's flags")
    p.add_argument("--textual_inversion", action="store_true",
                   help="the textual-inversion scripts' own flags (docs/textual_inversion.md)")
    p.add_argument("--write", metavar="PAGE", help="replace the flag tables of this Markdown page")
    a = p.parse_args()
    tables = tables_for(a.family, a.fine_tune, a.textual_inversion)
    if not a.write:
        print(tables)
        return
    with open(a.write, encoding="utf-8") as f:
        text = f.read()
    atomic_write_text(a.write, replace_tables(text, tables, a.write))


if __name__ == "__main__":
    main()
