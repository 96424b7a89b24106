"""The EMA of the trained weights alone (library/train/optim/ema.py): its decay, cadence, swap and state."""

import pytest
import torch

from library.train.optim.ema import EMA, EmaOptions


def one_weight(value=0.0):
    m = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(value)
    return m


def set_weight(m, value):
    with torch.no_grad():
        m.weight.fill_(value)


def test_warmup_decay_is_min_of_decay_and_1_plus_t_over_10_plus_t():
    ema = EMA(one_weight(), EmaOptions(use_ema=True, decay=0.5), torch.device("cpu"))
    assert [ema.decay() for ema.updates in range(3)] == [0.1, 2 / 11, 0.25]
    ema.updates = 20
    assert ema.decay() == 0.5
    assert EMA(one_weight(), EmaOptions(decay=0.9, warmup=False), torch.device("cpu")).decay() == 0.9


def test_the_average_starts_at_start_step_and_updates_every_n_steps():
    m = one_weight()
    ema = EMA(m, EmaOptions(use_ema=True, decay=0.5, warmup=False, update_every=2, start_step=3),
              torch.device("cpu"))
    for step in range(1, 8):
        set_weight(m, float(step))
        ema.step(step)
    # step 3 copies (3.0); steps 5 and 7 average: 0.5 * 3 + 0.5 * 5 = 4, then 0.5 * 4 + 0.5 * 7 = 5.5
    assert ema.shadow["weight"].item() == 5.5 and ema.updates == 2
    assert ema.shadow["weight"].dtype == torch.float32


def test_swapped_in_puts_the_average_in_place_and_the_weights_back():
    m = one_weight(1.0)
    ema = EMA(m, EmaOptions(use_ema=True), torch.device("cpu"))
    with ema.swapped_in():  # nothing averaged yet: the weights stay
        assert m.weight.item() == 1.0
    ema.step(1)
    set_weight(m, 3.0)
    with ema.swapped_in():
        assert m.weight.item() == 1.0
    assert m.weight.item() == 3.0


def test_state_round_trip_keeps_the_average_and_the_update_count():
    m = one_weight(2.0)
    ema = EMA(m, EmaOptions(use_ema=True, decay=0.9), torch.device("cpu"))
    assert ema.state() is None
    for step in (1, 2, 3):
        set_weight(m, float(step))
        ema.step(step)
    state = ema.state()
    assert set(state) == {"weight", "__ema_updates__"} and int(state["__ema_updates__"]) == 2
    again = EMA(m, EmaOptions(use_ema=True, decay=0.9), torch.device("cpu"))
    again.load_state(state)
    assert again.updates == 2 and torch.equal(again.shadow["weight"], ema.shadow["weight"])
    set_weight(m, 4.0)
    ema.step(4)
    again.step(4)
    assert again.shadow["weight"].item() == pytest.approx(ema.shadow["weight"].item(), abs=0)
