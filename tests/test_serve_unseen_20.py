"""Serving tried as a demanding user would, round 20: `asyncside bench serve` with more clients than
the server takes (its batch and its queue), whose surplus clients are answered 429, and as many
clients as it takes, one of which left and came back; a prompt too long for the KV allowance of
``--memory``; a bench phase's clock and a signal that lands in one of its clients.

The model is the scripted one (tests/_serving_support.py); everything between the socket and the
model is the real code.
"""

from __future__ import annotations

import asyncio
import gc
import pathlib
import time
import types
from typing import Any

import anyio
import pytest
import uvloop
from _serving_support import ScriptedModel, byte_tokenizer, scripted_engine

from asyncside.bench.serve import PhaseResult, RequestRecord, run_phase
from asyncside.serving import BackgroundServer, Batcher, ServeSettings, create_app
from asyncside.serving.kv_budget import KV_STEP, KVAdmission, KVLayout
from asyncside.serving.protocol import RequestError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

pytest.importorskip("httpx")

#: a reply long enough that the one admitted request outlasts the phase
LONG = "one two three four five six seven eight nine ten " * 4
#: the phase: shorter than the least Retry-After the server gives (a second)
PHASE_S = 0.5


def test_bench_clients_refused_with_429_wait_as_told_and_are_counted_apart(tmp_path: pathlib.Path) -> None:
    # One slot and no queue: of three clients, two are refused. Each must wait the Retry-After it
    # was given (at least a second, past the phase) before asking again, so it sends one request in
    # the phase; asking again at once made hundreds, every one counted as an error.
    tok = byte_tokenizer(tmp_path)
    model = ScriptedModel(tok, LONG, step_delay=0.05)
    app = create_app(scripted_engine(model), ServeSettings(max_batch=1, max_queue=0, prompt_cache_size=0))
    with BackgroundServer(app) as srv:
        res = uvloop.run(run_phase("asyncside", srv.url, "scripted", 3, PHASE_S, 100,
                                   lambda client, n: (f"#{client}.{n}: go", False)))
    assert len(res.records) == 3, f"{len(res.records)} requests from 3 clients"
    summary = res.summary()
    refused = [r for r in res.records if r.refused is not None]
    assert summary["error_count"] == 0, summary["errors"]
    assert summary["requests_refused"] == len(refused) == 2, summary
    assert all(r.refused >= 1.0 for r in refused)
    assert summary["requests_cut"] == 1  # the admitted one, still streaming at the deadline
    assert summary["tokens"] > 0


def test_a_refused_request_is_neither_cut_nor_an_error() -> None:
    res = PhaseResult("asyncside", 2, 1.0, records=[RequestRecord(False, refused=3.0), RequestRecord(False)])
    summary = res.summary()
    assert (summary["requests_refused"], summary["requests_cut"], summary["error_count"]) == (1, 1, 0)


@pytest.mark.anyio
async def test_a_request_that_left_does_not_hold_its_slot_against_the_next(tmp_path: pathlib.Path) -> None:
    # One slot, no queue: a client that left (or whose request finished) while the engine was
    # between the step that saw it and the next must not make the next request a 429 (at capacity
    # with "1 requests generating": its own, gone); it is taken, and runs once the slot is let go.
    tok = byte_tokenizer(tmp_path)
    b = Batcher(ScriptedModel(tok, LONG, step_delay=0.01), None, max_batch=1, max_queue=0, prompt_cache_size=0)
    got: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        first = b.submit(tok.encode("go"), 50)
        async for _ev in first:
            break
        async with b.paused():
            first.cancel()
            second = b.submit(tok.encode("again"), 3)
        got = [ev.token async for ev in second]
        tg.cancel_scope.cancel()
    assert len(got) == 3
    assert (b.active, b.waiting) == (0, 0)


@pytest.mark.parametrize("prompt, asked", [(1500, 16), (1500, 1), (600, 2000)], ids=["prompt", "prompt-one", "max"])
def test_a_refusal_of_the_kv_allowance_names_the_field_at_fault_and_what_fits(prompt: int, asked: int) -> None:
    # Under --memory a prompt too long for the KV allowance alone was told about 'max_tokens'
    # (param and message: "max_tokens (16)", the server's default, which the client never sent)
    # and to "ask for fewer tokens", which no max_tokens could satisfy. The field at fault is
    # named, with the most it may be.
    layout = KVLayout((128,), (None,))
    allowance = layout.bytes_for(1000, KV_STEP)
    kv = KVAdmission(layout, allowance, KV_STEP, "memory=1 GiB, test")
    fits = max(t for t in range(1, 3000) if layout.bytes_for(t, KV_STEP) <= allowance)
    with pytest.raises(RequestError) as refused:
        kv.check(prompt, asked)
    said = str(refused.value)
    assert refused.value.code == "kv_budget_exceeded" and "memory=1 GiB, test" in said
    if prompt + 1 > fits:
        assert refused.value.param == "prompt", said
        assert f"send a prompt of at most {fits - 1} tokens" in said and "max_tokens" not in said, said
        kv.check(fits - 1, 1)  # that prompt is taken
    else:
        assert refused.value.param == "max_tokens", said
        assert f"max_tokens of at most {fits - prompt} with this prompt" in said, said
        kv.check(prompt, fits - prompt)


# the connection a client was opening when the phase was torn down is never awaited, and says so
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_signal_that_lands_in_a_bench_client_ends_the_phase_without_a_traceback(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    # asyncside.cli turns SIGTERM into SystemExit raised wherever the main thread is: with many
    # clients, mostly inside one client's task. That task ended with it, nobody retrieved it, and
    # asyncio printed "Task exception was never retrieved" and its traceback under the run's exit.
    tok = byte_tokenizer(tmp_path)
    app = create_app(scripted_engine(ScriptedModel(tok, "ok")), ServeSettings(prompt_cache_size=0))

    def prompts(client: int, n: int) -> tuple[str, bool]:
        if client == 1 and n == 2:
            raise SystemExit(143)  # as the signal handler does, in this client's task
        return f"#{client}.{n}", False

    with BackgroundServer(app) as srv, pytest.raises(SystemExit):
        uvloop.run(run_phase("asyncside", srv.url, "scripted", 3, 30.0, 4, prompts))
    gc.collect()
    assert "never retrieved" not in caplog.text, caplog.text


def test_a_phase_lasts_until_its_deadline_not_until_its_clients_are_torn_down(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With 300 clients a 2 s phase reported 5 s (tokens per second divided by that): cancelling
    # hundreds of httpx streams takes seconds, and the phase's clock ran until they were closed.
    # Here a client's teardown moves the bench's clock by a minute, which the phase must not count.
    from asyncside.bench import serve as bench_serve

    skew = [0.0]
    real = time.perf_counter
    monkeypatch.setattr(bench_serve, "time", types.SimpleNamespace(perf_counter=lambda: real() + skew[0]))

    async def stream_once(client: Any, url: str, body: dict[str, Any], rec: RequestRecord) -> None:
        rec.sent = bench_serve.time.perf_counter()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            skew[0] += 60.0  # a slow teardown
            raise

    monkeypatch.setattr(bench_serve, "_stream_once", stream_once)
    res = uvloop.run(run_phase("asyncside", "http://127.0.0.1:9", "m", 2, PHASE_S, 4, lambda c, n: ("x", False)))
    assert PHASE_S <= res.seconds < 60.0, res.seconds
