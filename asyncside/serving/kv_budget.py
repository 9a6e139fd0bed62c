"""What served requests' KV caches take, from the model's config, and the engine's admission rule.

A request's KV cache and its worst case are :mod:`asyncside.kv_layout`'s (:class:`KVLayout`).

Under a memory budget the engine admits a waiting request only while the KV caches fit the plan's
KV allowance (:attr:`asyncside.runtime.MemoryPlan.kv_allowance_bytes`); see :class:`KVAdmission`.
Where the plan also reads past the page cache, every row evicted is a disk read: the engine then
admits no more requests at once than the pools' smallest layer holds one step's experts of
(:func:`rows_concurrency`). More would evict each other's experts within every step, and on a disk
that binds, the aggregate fell below one request's alone (BENCHMARKS.md, "Serving under a memory
budget"). Within that ceiling, how many pay depends on how much the requests' experts overlap:
:class:`~asyncside.serving.concurrency.ConcurrencyTuner` starts at one and climbs while the
measured tokens per second say so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..kv_layout import KV_STEP, KVLayout, dtype_bytes, kv_layout, model_kv_layout
from ..memory import describe_bytes
from .concurrency import ConcurrencyTuner

__all__ = ["KV_STEP", "KVAdmission", "KVLayout", "dtype_bytes", "kv_layout", "model_kv_layout", "plan_admission",
           "rows_concurrency"]


class KVAdmission:
    """Whether the engine may admit one more request under a KV allowance.

    The requests decoding together share mlx-lm's merged batch caches, every row padded to the
    longest, so the caches of ``n`` admitted requests are counted as ``n`` times the largest worst
    case among them (:meth:`KVLayout.bytes_for` of prompt + ``max_tokens``); the prefix cache's
    bytes count beside them. The engine admits the oldest waiting request only while that fits
    (:meth:`admits`), so one that does not fit holds back those behind it (first come, first
    admitted); :meth:`check` refuses at submission one whose worst case alone exceeds the
    allowance. ``allowance`` None: no limit. ``budget``: the memory budget, as refusals name it.
    """

    def __init__(self, layout: KVLayout, allowance: int | None, chunk: int = KV_STEP,
                 budget: str = "memory budget", max_active: int | None = None,
                 tuner: ConcurrencyTuner | None = None) -> None:
        self.layout = layout
        self.allowance = allowance
        self.chunk = chunk
        self.budget = budget
        #: requests generating at once that the pools' rows hold a step of (None: no such bound)
        self.max_active = max_active
        #: the limit within ``max_active`` that measurements choose (None: ``max_active`` itself)
        self.tuner = tuner
        self.waits = 0  # admissions deferred because the caches would not fit
        self.row_waits = 0  # admissions deferred because the pools' rows would not hold another request

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        """Worst-case bytes of one request's cache (its prompt and every token it may generate)."""
        return self.layout.bytes_for(prompt_tokens + max_tokens, self.chunk)

    def reserved(self, needs: Sequence[int]) -> int:
        """Bytes the caches of requests with worst cases ``needs`` may take together."""
        return len(needs) * max(needs) if needs else 0

    def fits(self, needs: Sequence[int], extra: int = 0) -> bool:
        """Whether requests with worst cases ``needs`` fit the allowance beside ``extra`` bytes."""
        return self.allowance is None or self.reserved(needs) + extra <= self.allowance

    @property
    def limit(self) -> int | None:
        """Requests that may generate at once now (None: no bound but the KV allowance)."""
        return self.tuner.limit if self.tuner is not None else self.max_active

    def observe(self, now: float, tokens: int, waiting: bool) -> None:
        """One engine turn, for the tuner (see :meth:`ConcurrencyTuner.observe`)."""
        if self.tuner is not None:
            self.tuner.observe(now, tokens, waiting)

    def admits(self, active: Sequence[Any], slot: Any, prefix_cache: Any) -> bool:
        """Whether ``slot`` (its ``kv_need``) fits beside the ``active`` requests, making room in
        ``prefix_cache`` (least recently used entries first) when that is what it takes."""
        limit = self.limit
        if limit is not None and len(active) >= limit:
            self.row_waits += 1
            return False
        needs = [s.kv_need for s in active] + [slot.kv_need]
        if self.fits(needs):
            while not self.fits(needs, prefix_cache.nbytes) and len(prefix_cache):
                prefix_cache.drop_oldest()
            if self.fits(needs, prefix_cache.nbytes):
                return True
        self.waits += 1
        return False

    def refusal(self, prompt_tokens: int, max_tokens: int, budget: str | None = None) -> str | None:
        """Why a request can never be admitted (its worst case alone exceeds the allowance), or None."""
        if self.allowance is None:
            return None
        need = self.need(prompt_tokens, max_tokens)
        if need <= self.allowance:
            return None
        per = f"{self.layout.bytes_per_token:,} bytes"
        past = (f"past the KV allowance of {describe_bytes(self.allowance)} under the memory budget "
                f"({budget or self.budget}); {per} a token, allocated {self.layout.step} tokens at a time")
        most = self._most_total(prompt_tokens + max_tokens)
        if prompt_tokens + 1 > most:  # no max_tokens helps: the prompt is what is too long
            return (f"the prompt ({prompt_tokens} tokens) may need {describe_bytes(self.need(prompt_tokens, 1))} of "
                    f"KV cache with even one token generated, {past}: "
                    + (f"send a prompt of at most {most - 1} tokens, or serve" if most > 1 else "serve")
                    + " with a larger --memory")
        return (f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) may need {describe_bytes(need)} "
                f"of KV cache, {past}: ask for max_tokens of at most {most - prompt_tokens} with this prompt, or "
                "serve with a larger --memory")

    def _most_total(self, refused: int) -> int:
        """The most tokens (prompt and generated) one request's KV cache may hold under the allowance,
        below ``refused`` (a total that does not fit)."""
        assert self.allowance is not None
        low, high = 0, refused
        while high - low > 1:  # bytes_for grows with the tokens: the last total that fits
            mid = (low + high) // 2
            low, high = (mid, high) if self.layout.bytes_for(mid, self.chunk) <= self.allowance else (low, mid)
        return low

    def most_tokens(self, prompt_tokens: int, up_to: int) -> int:
        """The largest ``max_tokens`` in [1, ``up_to``] that a prompt of ``prompt_tokens`` may ask
        for under the allowance; ``up_to`` itself where none fits (:meth:`check` then says why)."""
        if self.refusal(prompt_tokens, up_to) is None or self.refusal(prompt_tokens, 1) is not None:
            return up_to
        low, high = 1, up_to  # a request's worst case grows with its tokens: the last that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.refusal(prompt_tokens, mid) is None else (low, mid - 1)
        return low

    def check(self, prompt_tokens: int, max_tokens: int) -> int:
        """A request's worst case (its ``kv_need``); a 400 ``RequestError`` (code ``kv_budget_exceeded``)
        saying why when it can never be admitted."""
        from .protocol import RequestError

        refused = self.refusal(prompt_tokens, max_tokens)
        if refused is not None:
            too_long = self.refusal(prompt_tokens, 1) is not None  # then no max_tokens would do: the prompt's field
            raise RequestError(refused, param="prompt" if too_long else "max_tokens", code="kv_budget_exceeded")
        return self.need(prompt_tokens, max_tokens)


def plan_admission(model: Any, source: Any, chunk: int, prefix_cache: Any) -> KVAdmission | None:
    """The engine's admission under ``source``'s memory plan (its ``kv_allowance_bytes``), or None
    where the plan grants none (no memory budget, no plan). The prefix cache is bounded by the
    allowance too (its entries count against it)."""
    plan = getattr(source, "plan", None)
    allowance = getattr(plan, "kv_allowance_bytes", None)
    if not isinstance(allowance, int):
        return None
    prefix_cache.max_bytes = min(prefix_cache.max_bytes, allowance)
    budget = str(getattr(plan, "source", "memory budget"))
    ceiling = rows_concurrency(plan, model)
    tuner = None
    if ceiling is not None:
        # A count set by ASYNCSIDE_ROWS_CONCURRENCY is held as it is; the rows' own bound is a ceiling.
        fixed = isinstance(_rows_setting(), int)
        tuner = ConcurrencyTuner(ceiling, start=ceiling, fixed=True) if fixed else ConcurrencyTuner(ceiling)
    return KVAdmission(model_kv_layout(model), allowance, max(chunk, KV_STEP), budget, max_active=ceiling,
                       tuner=tuner)


def _rows_setting() -> int | str:
    """``ASYNCSIDE_ROWS_CONCURRENCY`` as read: ``"auto"`` (also unset), ``"off"`` or a count."""
    import os

    from ..native_env import ENV_ROWS_CONCURRENCY, env_rows_concurrency

    return env_rows_concurrency(os.environ.get(ENV_ROWS_CONCURRENCY, ""))


def rows_concurrency(plan: Any, model: Any) -> int | None:
    """Under a plan that reads past the page cache (``plan.direct``), how many requests may generate
    at once: as many as the smallest layer's pool rows hold one decode step's experts of (rows //
    the model's top-k, at least one). None where the plan reads through the page cache (a miss is
    then a copy, not a disk read) or the rows or the top-k are unknown.

    ``ASYNCSIDE_ROWS_CONCURRENCY`` overrides it: ``off`` (no bound, for A/B runs) or a count >= 1.
    """
    from ..runtime._forward_cost import config_top_k

    setting = _rows_setting()
    if setting == "off":
        return None
    if isinstance(setting, int):
        return setting
    rows = getattr(plan, "rows", None)
    if not getattr(plan, "direct", False) or not isinstance(rows, Mapping) or not rows:
        return None
    k = config_top_k(getattr(model, "config", None))
    if k is None:
        return None
    return max(1, min(int(r) for r in rows.values()) // k)
