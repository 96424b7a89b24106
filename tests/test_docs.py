"""The flag docs list every flag the parsers accept."""

import re

import pytest

from library.cli.entry import build_parser
from library.families import get_family


@pytest.mark.parametrize("page,fine_tune", [("docs/train_network.md", False), ("docs/fine_tune.md", True)])
def test_every_training_flag_is_documented(page, fine_tune):
    with open(page, encoding="utf-8") as f:
        documented = set(re.findall(r"`(--[a-z0-9_]+)", f.read()))
    parser = build_parser("", get_family("sd"), fine_tune)
    flags = {max(a.option_strings, key=len) for a in parser._actions if a.option_strings and a.dest != "help"}
    assert sorted(flags - documented) == []
