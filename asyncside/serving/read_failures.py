"""Which of an engine step's forwards a failed read belongs to (see :meth:`.engine.Batcher.step`).

A queued forward's failed read carries the id of the step that read it (``FillError.step``; the
step context's ``step`` is the id its source gave it). The runtime raises it where that step is
awaited, but where the step is not known (or at a forward built while it was in flight) it is
raised at another forward's await. Each failure the engine meets at a forward's build or await is
placed here: one whose reads all belong to forwards of this engine step fails those forwards'
requests alone, and a forward whose own read did not fail goes on; one that cannot be placed fails
every request whose forward was not awaited cleanly before it, as all of those may have read it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..errors import FillError
from .health import describe_failure, fill_errors
from .requests import Slot

log = logging.getLogger("asyncside.serving")


def log_failure(what: str, exc: BaseException) -> None:
    """Log a failed forward: one line for the store's faults (expected: a damaged blob, named by
    layer, expert and cause), the traceback for anything else (a bug)."""
    if fill_errors(exc):
        log.error("%s: %s", what, describe_failure(exc))
    else:
        log.error("%s", what, exc_info=exc)


def step_of(ctx: Any) -> int | None:
    """The id of the queued step a forward's context ran (None: not known, or not queued)."""
    step = getattr(ctx, "step", None)
    return step if isinstance(step, int) else None


def _only_reads(exc: BaseException) -> bool:
    """Whether ``exc`` is failed reads alone (a FillError, or groups of nothing else)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_reads(e) for e in exc.exceptions)
    return isinstance(exc, FillError)


class ReadFailures:
    """The failed reads met during one engine step, by the forward that read them."""

    def __init__(self) -> None:
        #: a failed read no forward of this engine step can be named for: every forward queued
        #: and not awaited cleanly before it was raised may have read it
        self.unplaced: BaseException | None = None
        #: step id -> the failed read that forward made, raised at another forward's build or await
        self.misread: dict[int, BaseException] = {}
        self._known: set[int] = set()

    def start(self, ctxs: Iterable[Any]) -> None:
        """A new engine step whose forwards (those to be awaited in it) ran the contexts ``ctxs``."""
        self.unplaced = None
        self.misread = {}
        self._known = {s for s in map(step_of, ctxs) if s is not None}

    def add(self, ctx: Any) -> None:
        """One more forward of this engine step (a chunk queued, a decode step launched ahead)."""
        step = step_of(ctx)
        if step is not None:
            self._known.add(step)

    def place(self, ctx: Any, exc: BaseException) -> bool:
        """Note ``exc``, raised where the forward that ran ``ctx`` was built or awaited. True when
        that forward itself is clean: every failed read in ``exc`` belongs to other forwards of
        this engine step (noted in :attr:`misread`), and nothing else failed with them. False when
        the forward fails with ``exc`` (its own read failed, or something other than a read)."""
        errors = fill_errors(exc)
        if not errors:
            return False  # not a failed read: the forward's own failure
        mine = step_of(ctx)
        steps = {e.step for e in errors}
        # Raised while another failure was being handled (the await itself failed): its own.
        placed = mine is not None and exc.__context__ is None and _only_reads(exc) \
            and None not in steps and steps <= self._known | {mine}
        if not placed:
            self.unplaced = exc
            return False
        for step in steps - {mine}:
            self.misread.setdefault(step, exc)  # type: ignore[arg-type]
        return mine not in steps

    def failed(self, forwards: list[tuple[list[Slot], Any]], clean: set[Slot]) -> list[tuple[Slot, BaseException]]:
        """Of ``forwards`` (each forward's requests and context), the requests to fail, with what:
        those of a forward whose own failed read was raised at another's await, and where a
        failed read no forward is named for was raised, every request not awaited cleanly
        (``clean``) before it, as all then queued may have read it."""
        out: list[tuple[Slot, BaseException]] = []
        for slots, ctx in forwards:
            exc = self.of(ctx)
            if exc is not None:
                log_failure("a forward's read failed", exc)
            out += [(s, exc or self.unplaced) for s in slots  # type: ignore[misc]
                    if exc is not None or (self.unplaced is not None and s not in clean)]
        return out

    def of(self, ctx: Any) -> BaseException | None:
        """The failed read noted for the forward that ran ``ctx`` (None: none)."""
        step = step_of(ctx)
        return None if step is None else self.misread.get(step)
