"""Which shape each engine forward takes under a memory plan that reads past the page cache.

Under such a plan (O_DIRECT: the store does not fit what the budget leaves for the page cache) a
prefill chunk whose experts may not fit a layer's lent rows at once is not cut in slices (their
transient buffers grow with its tokens and could take the process past its budget): it runs layer
by layer, each layer's groups of experts read and computed in turn. The engine avoids that with
shorter prefill chunks that fit the rows. A decode batch of up to the runtime's direct decode
tokens (0 unless set) is still cut in parts sorted by expert, so the batch reads each expert it
routes once; a larger one runs as one-row queued steps where those fit
(BENCHMARKS.md, "Serving under a memory budget").
"""

from __future__ import annotations

from typing import Any


def default_prefill_chunk() -> int:
    """Prompt tokens per engine step when none is configured: 512 on a GPU, 16 on the CPU.

    On a GPU a chunk of many tokens costs little more than one token, so large chunks keep a long
    prefill fast. On the CPU a prefilled token costs about as much as a decode step (each routed
    pair is its own product), so a small chunk gives the same prefill speed while holding the
    other streams for less time per step.
    """
    import mlx.core as mx

    return 512 if mx.default_device() == mx.gpu else 16


def bounded_prefill_chunk(asked: int | None, source: Any) -> int:
    """The engine's prompt tokens per step: ``asked`` (else :func:`default_prefill_chunk`), and under
    a memory budget no more than one forward's buffers fit the plan's room for
    (:meth:`asyncside.runtime.MemoryPlan.prompt_chunk`, at the start of a prompt)."""
    from ..models.streaming import prompt_chunk

    n = default_prefill_chunk() if asked is None else asked
    return n if n < 1 else prompt_chunk(source, n, cached=0)


class StepShapes:
    """The engine's questions about ``model``'s forward over ``source``, answered once where stable."""

    def __init__(self, model: Any, source: Any) -> None:
        self.model = model
        self.source = source
        self._fitting_chunk: int | None = None  # see queued_chunk

    def reads_past_page_cache(self) -> bool:
        """Whether the source's memory plan reads past the page cache (O_DIRECT)."""
        plan = getattr(self.source, "plan", None)
        return bool(getattr(plan, "direct", False))

    def queued(self, shape: tuple[int, int]) -> bool:
        """Whether a forward over inputs of ``shape`` (B, L) would run as a queued step now."""
        kind = getattr(self.model.forward, "kind", None)
        if kind is None:
            return False
        import mlx.core as mx

        from ..models.forward import StepMode

        return bool(kind(self.model.forward.context([], self.source), mx.zeros(shape, mx.int32)) is StepMode.QUEUED)

    def rows_apart(self, n: int) -> bool:
        """Whether a decode step of ``n`` requests runs as ``n`` one-row queued steps rather than one
        batched step: under a plan that reads past the page cache, when the batch cannot be queued
        (its experts may not fit the lent rows and it is too large to be cut in parts there) and one
        row can."""
        return self.reads_past_page_cache() and not self.queued((n, 1)) and self.queued((1, 1))

    def queued_chunk(self, n: int) -> int:
        """Prompt tokens per prefill forward: ``n``, or under a plan that reads past the page cache
        the most tokens up to ``n`` whose experts fit the lent rows (a queued chunk), when that is
        fewer (a chunk of ``n`` would go layer by layer)."""
        if n <= 1 or not self.reads_past_page_cache():
            return n
        # Found once and kept: a request's chunk boundaries must not depend on when it prefills.
        if self._fitting_chunk is None:
            self._fitting_chunk = next((m for m in range(n, 0, -1) if self.queued((1, m))), None)
        return n if self._fitting_chunk is None else min(n, self._fitting_chunk)
