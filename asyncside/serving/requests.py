"""One request inside the engine and the caller's handle on it.

:class:`Generation` is what :meth:`~.engine.Batcher.submit` returns: iterate it for
:class:`TokenEvent` s; the engine loop fills it through the request's :class:`Slot`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import AsyncsideError
from .health import describe_failure
from .protocol import SamplingParams


class QueueFull(AsyncsideError):
    """The engine's slots and its queue are full; ``retry_after`` is a hint in whole seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GenerationFailed(AsyncsideError):
    """A request's generation failed inside the engine (the model or the expert source raised)."""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``logprob`` and ``top`` are set when the request asked for log-probabilities."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    eos: bool = False


@dataclass(eq=False)
class Slot:
    """One request inside the engine."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    send: MemoryObjectSendStream[Any]
    submitted: float
    cache: list[Any] | None = None
    sampler: Any = None
    predictor: Any = None
    todo: list[int] = field(default_factory=list)  # tokens to feed: the prompt's rest, then the last token
    fed: list[int] = field(default_factory=list)   # tokens whose keys and values are in the cache
    generated: int = 0
    cached_tokens: int = 0
    cancelled: bool = False
    done: bool = False
    finish_reason: str | None = None
    #: the routing replay of the request's sequence (the engine's ``routing``); None: the router routes
    replay: Any = None
    #: worst-case bytes of the request's KV cache, counted against a KV allowance (0: none counted)
    kv_need: int = 0

    @property
    def prefilling(self) -> bool:
        return len(self.todo) > 1


@dataclass(eq=False)
class Chunk:
    """A prefill forward queued and not awaited: its requests (several for a joint chunk), its
    step context and its final hidden state (lazy; computed already for a chunk that ran per
    layer)."""

    slots: list[Slot]
    ctx: Any
    hidden: Any


@dataclass(eq=False)
class Step:
    """A decode step queued and not completed: its requests in row order, its context (None: it
    was awaited already), what its sampling built (lazy) and how to unpack it."""

    batch: list[Slot]
    ctx: Any
    values: Any
    layout: list[tuple[int, int, int]]


class Generation:
    """A caller's handle on one request: iterate it for :class:`TokenEvent` (``async for``), then
    read ``finish_reason``; ``cancel()`` leaves the engine at the next step boundary.

    Iteration raises :class:`GenerationFailed` if the engine failed the request.
    """

    def __init__(self, cancel: Callable[[Slot], None], slot: Slot, receive: MemoryObjectReceiveStream[Any]) -> None:
        self._leave = cancel  # the engine's: the request leaves at the next step boundary
        self._slot = slot
        self._receive = receive

    @property
    def prompt_tokens(self) -> int:
        return len(self._slot.prompt)

    @property
    def cached_tokens(self) -> int:
        return self._slot.cached_tokens

    @property
    def finish_reason(self) -> str | None:
        return self._slot.finish_reason

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        async for item in self._receive:
            if isinstance(item, BaseException):
                raise GenerationFailed(f"generation failed: {describe_failure(item)}") from item
            yield item

    def cancel(self) -> None:
        """Leave the engine (no-op once finished); safe to call more than once."""
        self._leave(self._slot)
        self._receive.close()
