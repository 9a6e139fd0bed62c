"""Sharing one streaming model and one expert source between concurrent requests.

:class:`GenerationService` hands each request an async iterator of token ids. Every decode step
of every request (one ``__anext__`` of the model's ``generate``; the first one includes the
prefill) runs while holding one FIFO lock, so requests take turns token by token: a long
generation cannot starve a short one, and the model and runtime see one step at a time. The
model's ``generate`` is per-request (its own KV cache), so steps of different requests are not
batched into one forward pass; the lock is what makes sharing fair and safe.

:class:`TextAssembler` turns the token stream into text deltas: it holds back an incomplete
UTF-8 sequence and any tail that could be the start of a stop sequence, and stops at the model's
EOS tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import anyio


class Tokenizer(Protocol):
    eos_token_ids: set[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class StreamingModel(Protocol):
    """What the server needs from a model (``asyncside.models`` provides it)."""

    model_id: str
    tokenizer: Any

    def generate(
        self, prompt_ids: list[int], *, max_tokens: int, source: Any, predictor: str = "lookahead"
    ) -> AsyncIterator[int]: ...


class GenerationService:
    """One model, one expert source, many requests taking fair turns per decode step."""

    def __init__(self, model: StreamingModel, source: Any, *, predictor: str = "lookahead") -> None:
        self.model = model
        self.source = source
        self.predictor = predictor
        self._turn = anyio.Lock()  # FIFO: a releaser queues behind the waiters already there
        self.active = 0    # generations started and not yet finished
        self.waiting = 0   # generations waiting for their turn right now
        self.steps = 0     # decode steps taken (tokens produced) by all requests

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @contextlib.asynccontextmanager
    async def _my_turn(self) -> AsyncIterator[None]:
        self.waiting += 1
        try:
            await self._turn.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._turn.release()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the turn: no generation takes a step until the block exits (maintenance, tests).

        Requests keep arriving and queue up fairly behind the holder.
        """
        async with self._my_turn():
            yield

    async def tokens(self, prompt_ids: Sequence[int], max_tokens: int) -> AsyncIterator[int]:
        """Yield the generated token ids of one request; close it (``aclosing``) when done early.

        Cancelling the consumer cancels the model's current step; the model's generator is then
        closed under shield and under the turn lock, so its cleanup (lease releases) cannot
        interleave with another request's step.
        """
        agen = self.model.generate(
            list(prompt_ids), max_tokens=max_tokens, source=self.source, predictor=self.predictor
        )
        self.active += 1
        try:
            while True:
                async with self._my_turn():
                    try:
                        token = await agen.__anext__()  # type: ignore[attr-defined]
                    except StopAsyncIteration:
                        return
                self.steps += 1
                yield int(token)
        finally:
            self.active -= 1
            with anyio.CancelScope(shield=True):
                async with self._my_turn():
                    await agen.aclose()  # type: ignore[attr-defined]


class TextAssembler:
    """Accumulates token ids and releases text that is final.

    ``push(id)`` returns the text that may be sent now. After a stop sequence or an EOS token,
    ``finished`` is True and ``finish_reason`` is ``"stop"``; the stop sequence itself is never
    sent (as OpenAI does). ``flush()`` returns what was held back when generation ended by length.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), eos_token_ids: set[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.eos = set(eos_token_ids if eos_token_ids is not None else getattr(tokenizer, "eos_token_ids", ()) or ())
        self.ids: list[int] = []
        self.completion_tokens = 0
        self.sent = 0          # characters of the decoded text already released
        self.text = ""         # everything released so far
        self.finished = False
        self.finish_reason: str | None = None

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if k > best and text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, token_id: int) -> str:
        if self.finished:
            return ""
        self.completion_tokens += 1
        if token_id in self.eos:
            self.finished, self.finish_reason = True, "stop"
            return self._release(self._decoded(final=True), final=True)
        self.ids.append(token_id)
        return self._release(self._decoded(final=False), final=False)

    def flush(self, finish_reason: str = "length") -> str:
        """Release everything held back; called when the model stops yielding."""
        if self.finished:
            return ""
        self.finished, self.finish_reason = True, finish_reason
        return self._release(self._decoded(final=True), final=True)

    def _decoded(self, *, final: bool) -> str:
        text = self.tokenizer.decode(self.ids) if self.ids else ""
        if not final:
            # An incomplete multi-byte character decodes to U+FFFD until its last byte arrives.
            text = text.rstrip("\ufffd")
        return text

    def _release(self, text: str, *, final: bool) -> str:
        if self.stop:
            start = max(0, self.sent - max(len(s) for s in self.stop))
            hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                cut = min(i for i, _ in hits)
                self.finished, self.finish_reason = True, "stop"
                return self._advance(text[:cut])
        if not final:
            text = text[: len(text) - self._held_tail(text)]
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if len(text) <= self.sent:
            return ""
        delta = text[self.sent :]
        self.sent = len(text)
        self.text += delta
        return delta
