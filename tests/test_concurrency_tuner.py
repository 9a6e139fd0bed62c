"""The serving engine's concurrency tuner (asyncside.serving.concurrency), driven by a simulated
engine: each turn lasts a tenth of a second and makes tokens at a rate that depends on the limit."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from asyncside.serving.concurrency import ConcurrencyTuner

TURN_S = 0.1


class Engine:
    """A simulated engine feeding one tuner: its clock and token count go on across :meth:`run` calls."""

    def __init__(self, tuner: ConcurrencyTuner) -> None:
        self.tuner = tuner
        self.now, self.made, self.carry = 0.0, 0, 0.0

    def run(self, rate: Callable[[int], float], seconds: float,
            waiting: Callable[[float], bool] = lambda now: True) -> Counter[int]:
        """``seconds`` of turns making ``rate(limit)`` tokens a second; returns the turns spent at each limit."""
        spent: Counter[int] = Counter()
        for _ in range(round(seconds / TURN_S)):
            self.carry += rate(self.tuner.limit) * TURN_S
            self.made += int(self.carry)
            self.carry -= int(self.carry)
            self.now += TURN_S
            spent[self.tuner.limit] += 1
            self.tuner.observe(self.now, self.made, waiting(self.now))
        return spent


def drive(tuner: ConcurrencyTuner, rate: Callable[[int], float], seconds: float,
          waiting: Callable[[float], bool] = lambda now: True) -> Counter[int]:
    return Engine(tuner).run(rate, seconds, waiting)


def share(spent: Counter[int], level: int) -> float:
    return spent[level] / sum(spent.values())


def test_one_at_a_time_wins_where_requests_evict_each_other() -> None:
    """Each request more reads the others' experts again: one stays best, the probes back off."""
    tuner = ConcurrencyTuner(4)
    spent = drive(tuner, lambda n: 20.0 / n, 2000)
    assert tuner.limit == 1
    assert share(spent, 1) > 0.9
    assert set(spent) == {1, 2}  # 2 lost to 1, so 3 was never tried
    assert tuner.kept == 0
    assert tuner.probes < 2000 / (2 * tuner.max_hold)  # backed off to one probe every max_hold windows


def test_climbs_to_the_ceiling_where_requests_share_experts() -> None:
    tuner = ConcurrencyTuner(4)
    spent = drive(tuner, lambda n: 10.0 * n ** 0.5, 600)
    assert tuner.limit == 4
    assert share(spent, 4) > 0.85
    assert tuner.kept >= 3


def test_settles_on_the_best_level_between() -> None:
    curve = {1: 10.0, 2: 14.0, 3: 17.0, 4: 15.0, 5: 12.0, 6: 9.0}
    tuner = ConcurrencyTuner(6)
    spent = drive(tuner, lambda n: curve[n], 1500)
    assert tuner.limit == 3
    assert share(spent, 3) > 0.8
    assert spent[5] == spent[6] == 0


def test_follows_a_change_of_workload() -> None:
    """Requests drawn apart first (one at a time best), then sharing their experts (four best)."""
    tuner = ConcurrencyTuner(4)
    engine = Engine(tuner)
    before = engine.run(lambda n: 20.0 / n, 600)
    assert tuner.limit == 1 and share(before, 1) > 0.85
    after = engine.run(lambda n: 10.0 * n, 600)
    assert tuner.limit == 4
    assert share(after, 4) > 0.5


def test_noise_below_the_margin_does_not_move_it() -> None:
    rng = random.Random(7)
    tuner = ConcurrencyTuner(3)
    spent = drive(tuner, lambda n: 12.0 * rng.uniform(0.98, 1.02), 2000)
    assert share(spent, 1) > 0.85  # equal rates: a probe never beats the margin


def test_windows_without_waiting_requests_say_nothing() -> None:
    tuner = ConcurrencyTuner(4)
    drive(tuner, lambda n: 10.0 * n, 300, waiting=lambda now: False)
    assert tuner.windows == 0 and tuner.limit == 1
    # waiting only now and then, never for a whole window: still nothing measured
    drive(tuner, lambda n: 10.0 * n, 300, waiting=lambda now: int(now * 10) % 10 != 0)
    assert tuner.windows == 0 and tuner.limit == 1


def test_a_fixed_limit_or_a_ceiling_of_one_never_moves() -> None:
    fixed = ConcurrencyTuner(2, start=5, fixed=True)
    drive(fixed, lambda n: 10.0 * n, 300)
    assert fixed.limit == 5 and fixed.windows == 0
    one = ConcurrencyTuner(1)
    drive(one, lambda n: 10.0, 300)
    assert one.limit == 1 and one.probes == 0
    snap = one.snapshot()
    assert snap["limit"] == 1 and snap["ceiling"] == 1 and snap["rates"] == {}


def test_refuses_a_limit_below_one() -> None:
    with pytest.raises(ValueError, match="ceiling and start"):
        ConcurrencyTuner(0)
    with pytest.raises(ValueError, match="ceiling and start"):
        ConcurrencyTuner(3, start=0)
