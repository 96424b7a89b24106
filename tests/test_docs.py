"""The flag docs list every flag the parsers accept, as the flags' declarations describe them."""

import re

import pytest

from library.cli.entry import build_parser
from library.families import get_family
from tools.make_flag_docs import BEGIN, END, tables_for

PAGES = [("docs/train_network.md", False), ("docs/fine_tune.md", True)]


@pytest.mark.parametrize("page,fine_tune", PAGES)
def test_every_training_flag_is_documented(page, fine_tune):
    with open(page, encoding="utf-8") as f:
        documented = set(re.findall(r"`(--[a-z0-9_]+)", f.read()))
    parser = build_parser("", get_family("sd"), fine_tune)
    flags = {o for a in parser._actions if a.dest != "help" for o in a.option_strings}
    assert sorted(flags - documented) == []


@pytest.mark.parametrize("page,fine_tune", PAGES)
def test_flag_tables_are_the_declarations(page, fine_tune):
    """The page holds exactly what tools/make_flag_docs.py makes from the declarations (--write refreshes it)."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    tables = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert tables.strip() == tables_for("sd", fine_tune).strip()


def test_textual_inversion_page_has_its_flags_and_tables():
    """docs/textual_inversion.md: the flags its scripts add (the others are train_network.md's), as declared."""
    with open("docs/textual_inversion.md", encoding="utf-8") as f:
        text = f.read()
    documented = set(re.findall(r"`(--[a-z0-9_]+)", text))
    lora = build_parser("", get_family("sd"))
    ti = build_parser("", get_family("sd"), textual_inversion=True)
    own = {o for a in ti._actions for o in a.option_strings} - {o for a in lora._actions for o in a.option_strings}
    assert own and sorted(own - documented) == []
    assert text.split(BEGIN, 1)[1].split(END, 1)[0].strip() == tables_for("sd", False, True).strip()
