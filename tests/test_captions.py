"""The caption pipeline, step by step, with fixed seeds (golden outputs)."""

import random

import pytest

from library.data.captions import (
    CaptionSettings,
    process_caption,
    resolve_wildcards,
    tag_frequency,
    warmup_steps,
)


def run(caption, seed=0, epoch=1, step=0, max_steps=100, **settings):
    return process_caption(caption, CaptionSettings(**settings), random.Random(seed), epoch, step, max_steps)


def test_plain_caption_is_untouched_and_first_line_only():
    assert run("a  photo,of   sks") == "a  photo,of   sks"
    assert run("first line\nsecond line") == "first line"


def test_prefix_and_suffix():
    assert run("a, b", caption_prefix="pre", caption_suffix="suf") == "pre a, b suf"


def test_caption_dropout_by_rate_and_every_n_epochs():
    assert run("a, b", caption_dropout_rate=1.0) == ""
    assert run("a, b", caption_dropout_every_n_epochs=2, epoch=2) == ""
    assert run("a, b", caption_dropout_every_n_epochs=2, epoch=3) == "a, b"


def test_wildcards_pick_a_line_and_choices_with_seed():
    caption = "{red|blue|green} cat, {{x}}\nsecond {a|b}"
    assert run(caption, seed=0, enable_wildcard=True) == "second b"
    assert run(caption, seed=3, enable_wildcard=True) == "green cat, {x}"
    assert resolve_wildcards("{{literal}} {one}", random.Random(0)) == "{literal} one"


def test_keep_tokens_keeps_the_first_tags_in_place():
    assert run("a, b, c, d, e", shuffle_caption=True, keep_tokens=1) == "a, d, b, c, e"


def test_keep_tokens_separator_three_parts():
    out = run("a, b ||| c, d, e ||| f, g", shuffle_caption=True, keep_tokens_separator="|||")
    assert out == "a, b, c, e, d, f, g"


def test_secondary_separator_keeps_tags_together_then_joins_them():
    assert run("a;;;b, c, d", seed=1, shuffle_caption=True, secondary_separator=";;;") == "c, d, a,b"


def test_tag_dropout_with_seed():
    assert run("a, b, c, d, e, f", caption_tag_dropout_rate=0.5) == "a, b, e"


def test_prefix_is_part_of_the_first_tag_and_suffix_of_the_last():
    out = run("sks, a, b, c, d", seed=5, shuffle_caption=True, keep_tokens=1, caption_prefix="photo of",
              caption_suffix="best")
    assert out == "photo of sks, a, b, d best, c"


@pytest.mark.parametrize("step, expected", [(0, "a"), (1, "a, b"), (2, "a, b, c"), (3, "a, b, c, d"),
                                            (4, "a, b, c, d, e"), (9, "a, b, c, d, e")])
def test_token_warmup_grows_the_caption(step, expected):
    assert run("a, b, c, d, e", step=step, token_warmup_step=4) == expected


def test_token_warmup_fraction_of_max_steps():
    assert warmup_steps(0.5, 8) == 4 and warmup_steps(10, 8) == 10
    assert run("a, b, c, d, e", step=2, max_steps=8, token_warmup_step=0.5) == "a, b, c"


def test_replacements_apply_last():
    out = process_caption("a sks, b", CaptionSettings(), random.Random(0), 1, 0, 10, replacements=(("sks", "<t1> <t2>"),))
    assert out == "a <t1> <t2>, b"


def test_validation_settings_remove_randomness():
    s = CaptionSettings(shuffle_caption=True, caption_dropout_rate=1.0, caption_tag_dropout_rate=1.0,
                        token_warmup_step=5, caption_prefix="p").without_randomness()
    assert process_caption("a, b, c", s, random.Random(0), 1, 0, 10) == "p a, b, c"


def test_tag_frequency_lowercases_and_counts():
    assert tag_frequency(["Sks, red", "sks, blue, red", ""]) == {"sks": 2, "red": 2, "blue": 1}
