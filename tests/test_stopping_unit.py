"""The run's stop handler alone (library/train/stopping.py), with real signals sent to this process."""

import signal

import pytest

from library.train.stopping import StopHandler, StopRequested, nan_hint


@pytest.fixture
def handler():
    h = StopHandler().install()
    yield h
    h.uninstall()


def test_before_the_loop_a_signal_stops_at_once(handler):
    with pytest.raises(StopRequested):
        signal.raise_signal(signal.SIGTERM)
    assert handler.signum == signal.SIGTERM and handler.requested


def test_in_the_loop_the_first_signal_asks_and_the_second_stops_at_once(handler):
    handler.in_loop = True
    assert not handler.requested
    signal.raise_signal(signal.SIGINT)  # no exception: the loop saves after the current step
    assert handler.requested and handler.signum == signal.SIGINT
    with pytest.raises(StopRequested, match="a second time, during a step"):
        signal.raise_signal(signal.SIGINT)


def test_uninstall_gives_the_previous_handlers_back():
    before = signal.getsignal(signal.SIGINT)
    h = StopHandler().install()
    assert signal.getsignal(signal.SIGINT) != before
    h.uninstall()
    assert signal.getsignal(signal.SIGINT) == before


def test_nan_hint_offers_only_changes_the_run_has_not_made():
    assert nan_hint("fp16", max_grad_norm=1.0) == \
        "try --mixed_precision bf16 (or no, for float32), --no_half_vae or a lower learning rate"
    assert nan_hint("no", max_grad_norm=0.0) == "try --max_grad_norm 1 (gradient clipping is off) or a lower learning rate"
    assert nan_hint("bf16", full_bf16=True, no_half_vae=True) == \
        "try --mixed_precision no (float32), training without --full_bf16 or a lower learning rate"
