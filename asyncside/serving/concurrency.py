"""How many requests generate at once where every pool miss is a disk read: a hill climb on the
tokens per second the engine measures (sans-I/O: the engine hands it its clock and token count).

Under a plan that reads past the page cache, a request admitted beside others brings its own
experts into every layer's pools, evicting theirs: the step reads the union of the batch's misses.
Whether a larger batch pays depends on how much the requests' experts overlap, which nothing knows
before they run. On synthetic routing drawn apart, one request at a time was best even where the
rows held two requests' experts; where requests share experts, more at once pays (BENCHMARKS.md,
"Serving under a memory budget"). So the engine starts at one request and lets the measurements
decide, within the ceiling the rows set (:func:`asyncside.serving.kv_budget.rows_concurrency`).

The climb: each window (at least :data:`WINDOW_S` seconds and :data:`WINDOW_TOKENS` tokens during
which requests waited, so the limit bound) measures the tokens per second at the current limit. A
probe moves the limit one step; its first window decides: kept only if it beat the level it left by
:data:`MARGIN`, else the limit goes back and the next probe waits twice as many windows (at most
:data:`MAX_HOLD`), trying the other neighbour where there is one. A kept probe is followed by
another the same way one window later. Windows during which nobody waited say nothing of the
limit and are dropped.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MARGIN", "MAX_HOLD", "WINDOW_S", "WINDOW_TOKENS", "ConcurrencyTuner"]

#: a window lasts at least this many seconds: long enough to hold several requests' turnover
WINDOW_S = 2.0
#: ... and this many generated tokens: at a few tokens a second, a window is several seconds
WINDOW_TOKENS = 16
#: a probe is kept only if its rate beats the level it left by this share (noise on a shared host)
MARGIN = 0.05
#: at most this many windows between probes after probes kept failing
MAX_HOLD = 16


class ConcurrencyTuner:
    """The engine's limit on requests generating at once, between 1 and ``ceiling`` (see the module
    docstring). ``fixed``: the limit stays at ``start`` (``ASYNCSIDE_ROWS_CONCURRENCY=N``).

    :meth:`observe` after every engine turn; :attr:`limit` is what admission holds to.
    """

    def __init__(self, ceiling: int, *, start: int = 1, fixed: bool = False, window_s: float = WINDOW_S,
                 window_tokens: int = WINDOW_TOKENS, margin: float = MARGIN, max_hold: int = MAX_HOLD) -> None:
        if ceiling < 1 or not 1 <= start:
            raise ValueError(f"ceiling and start must be >= 1, got {ceiling} and {start}")
        self.ceiling = ceiling
        self.fixed = fixed
        #: requests the engine lets generate at once now
        self.limit = start if fixed else min(start, ceiling)
        self.window_s = window_s
        self.window_tokens = window_tokens
        self.margin = margin
        self.max_hold = max_hold
        #: tokens per second measured at each limit (a level's windows, each averaged with the last)
        self.rates: dict[int, float] = {}
        self.windows = 0  # windows measured
        self.probes = 0  # probes started
        self.kept = 0  # probes kept
        self._mark: tuple[float, int] | None = None  # (clock, tokens) where the current window began
        self._probe_from: int | None = None  # the level a probe left, while its window runs
        self._wait = 1  # windows before the next probe
        self._hold = 1  # windows to wait after the next rejected probe
        self._step = 1  # the next probe's direction (+1 up, -1 down)

    def observe(self, now: float, tokens: int, waiting: bool) -> None:
        """One engine turn: ``now`` a monotonic clock in seconds, ``tokens`` the engine's tokens
        generated so far, ``waiting`` whether requests wait for admission (the limit binds)."""
        if self.fixed or self.ceiling == 1:
            return
        if not waiting:
            self._mark = None
            return
        if self._mark is None:
            self._mark = (now, tokens)
            return
        began, before = self._mark
        seconds, made = now - began, tokens - before
        if seconds < self.window_s or made < self.window_tokens:
            return
        self._mark = (now, tokens)
        self._judge(made / seconds)

    def _judge(self, rate: float) -> None:
        self.windows += 1
        level = self.limit
        known = self.rates.get(level)
        self.rates[level] = rate if known is None else (known + rate) / 2
        if self._probe_from is not None:
            left, self._probe_from = self._probe_from, None
            if rate > self.rates[left] * (1 + self.margin):
                self.kept += 1
                self._hold, self._wait = 1, 1
                self._step = 1 if level > left else -1
                return
            self._move(left)  # not better: back, and wait longer before trying again
            self._wait, self._hold = self._hold, min(2 * self._hold, self.max_hold)
            self._step = 1 if level < left else -1  # the other neighbour next
            return
        self._wait -= 1
        if self._wait > 0:
            return
        target = level + self._step
        if not 1 <= target <= self.ceiling:
            self._step = -self._step
            target = level + self._step
        if 1 <= target <= self.ceiling:
            self.probes += 1
            self._probe_from = level
            self._move(target)

    def _move(self, level: int) -> None:
        self.limit = level
        self._mark = None  # a window measures one level: the next starts after the change

    def snapshot(self) -> dict[str, Any]:
        """The tuner's state, for /health and benchmark results."""
        return {"limit": self.limit, "ceiling": self.ceiling, "fixed": self.fixed, "windows": self.windows,
                "probes": self.probes, "kept": self.kept,
                "rates": {str(k): round(v, 3) for k, v in sorted(self.rates.items())}}
