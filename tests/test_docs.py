"""The flag docs list every flag the parsers accept."""

import re

from library.cli.entry import build_parser
from library.families import get_family


def test_every_train_network_flag_is_documented():
    with open("docs/train_network.md", encoding="utf-8") as f:
        documented = set(re.findall(r"`(--[a-z0-9_]+)", f.read()))
    parser = build_parser("", get_family("sd"))
    flags = {max(a.option_strings, key=len) for a in parser._actions if a.option_strings and a.dest != "help"}
    assert sorted(flags - documented) == []
