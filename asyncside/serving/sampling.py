"""Per-request token sampling, as mlx-lm samples (``mlx_lm.sample_utils``), reproducible per request.

A :class:`RequestSampler` holds one request's logits processors (``make_logits_processors``:
logit bias, repetition / presence / frequency penalties over the last tokens, prompt included)
and its sampler: the argmax of the log-probabilities when the temperature is 0 (exactly mlx-lm's
greedy step), else mlx-lm's filters in mlx-lm's order (``apply_top_p``, ``apply_min_p``,
``apply_top_k``) and a categorical draw at the temperature.

The draw uses a key of its own per request and step (``mx.random.key`` of the request's seed and
the step number), never MLX's global random state: a request with a seed gets the same tokens
whether it runs alone or in a batch beside others, and requests never perturb each other.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from .protocol import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_key(seed: int, step: int) -> mx.array:
    """The random key of draw ``step`` of a request seeded ``seed`` (independent of any other request)."""
    return mx.random.key(_splitmix64(seed ^ _splitmix64(step)))


@dataclass
class Draw:
    """One step's lazy results for one request: the token, its log-probability, the top alternatives."""

    token: mx.array          # (1,) uint32
    logprob: mx.array | None  # (1,) the chosen token's log-probability
    top_ids: mx.array | None  # (n,) alternatives, unordered
    top_logprobs: mx.array | None


class RequestSampler:
    """One request's logits processors and sampler (see the module docstring)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int | None = None) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.steps = 0
        bias = dict(params.logit_bias) if params.logit_bias else None
        self.processors = make_logits_processors(
            bias, params.repetition_penalty, params.repetition_context_size, params.presence_penalty,
            params.presence_context_size, params.frequency_penalty, params.frequency_context_size,
        )
        self.context = max(params.repetition_context_size, params.presence_context_size,
                           params.frequency_context_size)
        # mlx-lm's penalties look at the last tokens of prompt + generation.
        self.history: list[int] = list(prompt_ids)[-self.context:] if self.processors else []
        filters: list[Any] = []
        if 0.0 < params.top_p < 1.0:
            filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p != 0.0:
            filters.append(lambda x: apply_min_p(x, params.min_p, 1))
        if params.top_k > 0 and (vocab_size is None or params.top_k < vocab_size):
            filters.append(lambda x: apply_top_k(x, params.top_k))
        self.filters = filters

    def draw(self, logits: mx.array) -> Draw:
        """Sample from one position's logits, shape (1, vocab); lazy."""
        p = self.params
        if self.processors:
            tokens = mx.array(self.history[-self.context:], dtype=mx.uint32)
            for proc in self.processors:
                logits = proc(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if p.greedy:
            token = mx.argmax(logprobs, axis=-1)
        else:
            filtered = logprobs
            for f in self.filters:
                filtered = f(filtered)
            token = mx.random.categorical(filtered * (1.0 / p.temperature), key=step_key(self.seed, self.steps))
        self.steps += 1
        if not p.logprobs:
            return Draw(token.astype(mx.uint32), None, None, None)
        row = logprobs[0]
        chosen = mx.take(row, token.astype(mx.uint32))
        top_ids = top_lps = None
        if p.top_logprobs > 0:
            n = min(p.top_logprobs, row.shape[-1])
            top_ids = mx.argpartition(-row, kth=n - 1)[:n]
            top_lps = mx.take(row, top_ids)
        return Draw(token.astype(mx.uint32), chosen, top_ids, top_lps)

    @property
    def plain_greedy(self) -> bool:
        """Greedy, no logits processors, no log-probabilities: the draw is the argmax alone."""
        return self.params.greedy and not self.processors and not self.params.logprobs

    def accept(self, token: int) -> None:
        """Record a generated token (the penalties' context)."""
        if self.processors:
            self.history.append(token)
            if len(self.history) > 4 * self.context:
                del self.history[: -self.context]


def pack(draws: Sequence[Draw]) -> tuple[mx.array, list[tuple[int, int, int]]]:
    """All draws of a step in one float32 vector (evaluated with one completion), and per draw
    (offset, has logprob, number of alternatives) to unpack it with :func:`unpack`."""
    parts: list[mx.array] = []
    layout = []
    at = 0
    for d in draws:
        start = at
        parts.append(d.token.astype(mx.float32).reshape(-1))
        at += 1
        has = d.logprob is not None
        if has:
            parts.append(d.logprob.astype(mx.float32).reshape(-1))  # type: ignore[union-attr]
            at += 1
        n = 0
        if d.top_ids is not None and d.top_logprobs is not None:
            n = d.top_ids.shape[0]
            parts.append(d.top_ids.astype(mx.float32))
            parts.append(d.top_logprobs.astype(mx.float32))
            at += 2 * n
        layout.append((start, int(has), n))
    return mx.concatenate(parts), layout


def draw_step(samplers: Sequence[RequestSampler], logits: mx.array) -> tuple[mx.array, list[tuple[int, int, int]]]:
    """One step's draws of a batch, ``logits`` (B, vocab) with row i for ``samplers[i]``, packed as
    :func:`pack` packs them (lazy).

    When every request is :attr:`~RequestSampler.plain_greedy`, the batch's tokens are one argmax
    over the batch's log-probabilities, as mlx-lm's batched generation computes them (each row's
    reduction is its own: the tokens are those of the rows drawn one by one), instead of a few
    graph nodes per request.
    """
    if samplers and all(s.plain_greedy for s in samplers):
        for s in samplers:
            s.steps += 1
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1).astype(mx.float32)
        return tokens, [(i, 0, 0) for i in range(len(samplers))]
    return pack([s.draw(logits[i:i + 1]) for i, s in enumerate(samplers)])


def unpack(values: list[float], layout: Sequence[tuple[int, int, int]]
           ) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
    """Per draw: (token, its logprob or None, [(alternative id, logprob)] best first)."""
    out = []
    for start, has, n in layout:
        token = int(values[start])
        lp = values[start + 1] if has else None
        at = start + 1 + has
        alts = [(int(values[at + i]), values[at + n + i]) for i in range(n)]
        alts.sort(key=lambda a: (-a[1], a[0]))
        out.append((token, lp, alts))
    return out
