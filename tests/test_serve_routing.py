"""Routing replay in the serving engine: every row of a batched step routes to its own request's
trace ids, and a replayed batch's tokens equal each request's tokens generated alone under the
same replay.

A :class:`~asyncside.serving.Batcher` with ``routing=`` over the embedded model and a Runtime
keeping a quarter of each layer's experts (misses in every layer): request ``n`` replays trace
sequence ``n mod S`` from its own first prompt token. The routed ids are read back from a routing
trace the steps record (what each MoE layer's switch was given), row by row, and compared with
the trace file's ids at each row's positions, computed here from the file.
"""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import numpy as np
import pytest

from asyncside.audit import audit_problems
from asyncside.models import RoutingTrace, load_streaming_model
from asyncside.models.forcing import RoutingReplay, RoutingReplayError, RowsReplay, sequence_replays
from asyncside.routing import RoutingTrace as TraceFile
from asyncside.routing import synthetic
from asyncside.runtime import Runtime
from asyncside.serving import Batcher, embedded_store_dir

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHUNK = 16
NEW = 6
SEQUENCES = 3


@pytest.fixture(scope="module")
def sm() -> Any:
    return load_streaming_model(embedded_store_dir())


def _trace_file(tmp: pathlib.Path, sm: Any) -> pathlib.Path:
    # The model's own shape (replayed as is), three sequences of different lengths, the shortest
    # shorter than a prompt plus its tokens (positions wrap).
    n_experts = sm.store.layer(sm.moe_layers[0]).n_experts
    trace = synthetic(tokens=23 + 40 + 31, n_layers=len(sm.moe_layers), n_experts=n_experts,
                      top_k=sm.forward.walk.top_k, skew=0.3, overlap=0.2, layer_corr=0.1, seed=7)
    path = tmp / "serve-trace.npz"
    TraceFile(trace.ids, np.array([23, 40, 31]), trace.n_experts, dict(trace.meta)).save(path)
    return path


def _prompts(sm: Any) -> list[list[int]]:
    tok = sm.tokenizer
    texts = ["The quick brown fox", "0 1 2 3 4", "MoE",
             "Mixture-of-Experts models route every token to a few experts out of many. " * 2]
    return [tok.encode(t) for t in texts]


async def _alone(sm: Any, rt: Runtime, path: pathlib.Path, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for n, prompt in enumerate(prompts):
        sm.set_routing(path, sequence=n % SEQUENCES)
        try:
            out.append([t async for t in sm.generate(prompt, max_tokens=NEW, source=rt, predictor="none")])
        finally:
            sm.set_routing(None)
    return out


async def _served(b: Batcher, prompts: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]
    gens = [b.submit(p, NEW) for p in prompts]

    async def read(i: int) -> None:
        async for ev in gens[i]:
            out[i].append(ev.token)

    async with anyio.create_task_group() as tg:
        tg.start_soon(b.run)
        async with anyio.create_task_group() as readers:
            for i in range(len(gens)):
                readers.start_soon(read, i)
        tg.cancel_scope.cancel()
    return out


@pytest.mark.parametrize("joint_prefill", [False, True])
def test_a_replayed_batch_routes_each_row_to_its_trace_and_equals_each_request_alone(
        tmp_path: pathlib.Path, sm: Any, joint_prefill: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _trace_file(tmp_path, sm)
    trace = TraceFile.load(path)
    prompts = _prompts(sm)
    assert len(prompts[-1]) > 2 * CHUNK  # prefilled in chunks beside the others' decode rows
    replay = sm.set_routing(path)
    sm.set_routing(None)
    assert isinstance(replay, RoutingReplay)

    fwd = sm.forward
    contexts: list[Any] = []
    record = RoutingTrace()
    plain_context = fwd.context

    def recording_context(cache: Any, source: Any, predictor: Any = None, trace: Any = None) -> Any:
        ctx = plain_context(cache, source, predictor, record)
        contexts.append(ctx)
        return ctx

    async def main() -> tuple[list[list[int]], list[list[int]], list[list[int]], int]:
        async with Runtime(sm.store, resident=0.25) as rt:
            alone = await _alone(sm, rt, path, prompts)
            free = await _served(Batcher(sm, rt, prefill_chunk=CHUNK, prompt_cache_size=0), prompts)
            with monkeypatch.context() as m:
                m.setattr(fwd, "context", recording_context)
                b = Batcher(sm, rt, prefill_chunk=CHUNK, prompt_cache_size=8, joint_prefill=joint_prefill,
                            predictor="none", routing=replay)
                assert not b.prefix_cache.enabled  # a cached prefix would hold another request's routing
                served = await _served(b, prompts)
            await rt.quiesce()
            misses = sum(rt.ledger(layer).stats["misses"] for layer in sm.moe_layers)
        assert audit_problems(rt) == []
        assert b.peak_batch == len(prompts)
        if joint_prefill:
            assert b.prefill_joined >= 2
        return alone, free, served, misses

    alone, free, served, misses = anyio.run(main)
    assert served == alone
    assert free != alone  # the replay changed the tokens
    assert misses > 0

    # Every row of every forward routed to its own request's trace ids at its own positions.
    batched = mixed = 0
    for ctx in contexts:
        rows = ctx.routing
        if rows is None or not ctx.record.layers:
            continue  # the engine's probe of what kind a step would be: never run
        assert isinstance(rows, RowsReplay) and ctx.position == 0
        batched += len(rows.rows) > 1
        mixed += len({pos for _r, pos in rows.rows}) > 1
        for j, layer in enumerate(sm.moe_layers):
            got = ctx.record.layers[layer].ids.reshape(len(rows.rows), -1, replay.top_k)
            for b, (row, pos) in enumerate(rows.rows):
                ids = trace.sequence(row.sequence)
                want = ids[(pos + np.arange(got.shape[1])) % ids.shape[0], j, :]
                assert np.array_equal(got[b], want), (layer, b, pos)
    assert batched > 0 and mixed > 0  # batched steps whose rows sat at different positions
    # Request n replayed sequence n mod S.
    seen = {row.sequence for ctx in contexts if ctx.routing is not None for row, _ in ctx.routing.rows}
    assert seen == set(range(SEQUENCES))


def test_rows_replay_refuses_what_it_cannot_force(tmp_path: pathlib.Path, sm: Any) -> None:
    replay = sm.set_routing(_trace_file(tmp_path, sm))
    sm.set_routing(None)
    assert isinstance(replay, RoutingReplay)
    seqs = sequence_replays(replay)
    assert [r.sequence for r in seqs] == list(range(SEQUENCES))
    rows = RowsReplay([(seqs[0], 0), (seqs[2], 29)])
    out = np.array(rows.step_ids(sm.moe_layers[1], 0, (2, 3)))
    assert out.shape == (2, 3, replay.top_k)
    assert np.array_equal(out[1], seqs[2].host_ids(sm.moe_layers[1], 29, 3))  # wraps past its 31 tokens
    with pytest.raises(RoutingReplayError, match=r"2 row\(s\).*got \(3, 1\)"):
        rows.step_ids(sm.moe_layers[0], 0, (3, 1))
    with pytest.raises(RoutingReplayError, match="position must be >= 0"):
        RowsReplay([(seqs[0], -1)])
    with pytest.raises(TypeError, match="RoutingReplay"):
        Batcher(sm, None, routing=["not a replay"])
    sm.set_routing(replay)
    try:
        with pytest.raises(ValueError, match="routing="):
            Batcher(sm, None, routing=replay)
    finally:
        sm.set_routing(None)


def test_serve_budget_and_routing_options(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncside.cli import build_parser
    from asyncside.serving.cli import serve_main

    trace = tmp_path / "t.npz"
    trace.write_bytes(b"")  # parsing only checks that the file is there; loading it checks the rest
    for command in (["serve"], ["bench", "serve"]):
        args = build_parser().parse_args([*command, "--resident", "auto", "--memory", "1.5G", "--routing", str(trace)])
        assert (args.resident, args.memory, args.routing) == ("auto", 3 << 29, str(trace))
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--routing", str(tmp_path / "missing.npz")])
    assert info.value.code == 2 and "missing.npz: no such routing trace file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--memory", "lots"])
    assert "--memory" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--pipeline", "--routing", str(trace)])
    assert serve_main(args) == 2
    assert "--routing is not supported with --pipeline" in capsys.readouterr().err


@pytest.mark.parametrize("decode_tokens", ["16", None])
def test_past_the_page_cache_a_batch_too_large_for_the_rows_decodes_queued_and_exact(
        tmp_path: pathlib.Path, sm: Any, monkeypatch: pytest.MonkeyPatch, decode_tokens: str | None) -> None:
    """Under a plan that reads past the page cache (O_DIRECT) a prefill chunk is not cut in
    slices: one whose experts may not fit a layer's lent rows would go layer by layer, so the
    engine prefills in chunks whose experts fit. A decode batch too large for the rows is cut in
    parts sorted by expert (one batched queued step) where ``ASYNCSIDE_DIRECT_DECODE_TOKENS``
    allows it; with the bound at 0 (the default) the engine runs it as one-row queued steps.
    Tokens stay each request's own either way."""
    if decode_tokens is not None:
        monkeypatch.setenv("ASYNCSIDE_DIRECT_DECODE_TOKENS", decode_tokens)
    batched = decode_tokens is not None
    path = _trace_file(tmp_path, sm)
    replay = sm.set_routing(path)
    sm.set_routing(None)
    assert isinstance(replay, RoutingReplay)
    # Prompts of one length: their one-token prefill chunks end together, so they decode as a batch.
    prompts = [p[:3] for p in _prompts(sm)]
    counters = sm.forward.counters

    async def main() -> tuple[list[list[int]], list[list[int]], dict[str, int], Batcher]:
        # One token's experts fit a layer's rows; two tokens' may not.
        async with Runtime(sm.store, resident=0.0, min_side_rows=replay.top_k, direct=True) as rt:
            assert rt.plan is not None and rt.plan.direct
            alone = await _alone(sm, rt, path, prompts)
            before = dict(counters)
            b = Batcher(sm, rt, prefill_chunk=CHUNK, predictor="none", routing=replay)
            served = await _served(b, prompts)
            spent = {k: counters[k] - before[k] for k in counters}
        assert audit_problems(rt) == []
        return alone, served, spent, b

    alone, served, spent, b = anyio.run(main)
    assert served == alone
    assert b.peak_batch == len(prompts) and b.shapes._fitting_chunk == 1
    assert spent["per_layer"] == 0 and spent["prefill"] == spent["queued_prefill"] > 0  # nothing went per layer
    assert b.shapes.rows_apart(len(prompts)) is not batched
    # A prefill chunk per prompt token before its last; decode steps batched in sorted parts, or
    # one row per queued forward (a step per request and token after its first).
    assert spent["queued_prefill"] >= sum(len(p) - 1 for p in prompts)
    if batched:
        assert spent["sorted_parts"] > 0 and spent["queued"] < len(prompts) * (NEW - 1)
    else:
        assert spent["sorted_parts"] == 0 and spent["queued"] >= len(prompts) * (NEW - 1)


def test_open_engine_takes_a_budget_and_a_routing_trace(tmp_path: pathlib.Path, sm: Any) -> None:
    from asyncside.serving import open_engine

    path = _trace_file(tmp_path, sm)

    async def main() -> None:
        async with open_engine(embedded_store_dir(), resident="auto", memory="4G", routing=path) as engine:
            assert isinstance(engine.routing, RoutingReplay)
            assert engine.routing.fitted.n_sequences == SEQUENCES
            assert engine.model.forward.routing is None  # replayed per request by the engine, not batch-1
            d = engine.description
            shown = {k: d["routing"][k] for k in ("file", "tokens", "sequences")}
            assert shown == {"file": path.name, "tokens": 23, "sequences": SEQUENCES}  # no host path
            assert d["routing"]["mapped_from"] is None and d["routing"]["note"] is None  # the model's own shape
            assert d["memory_budget"] == "4G" and "memory budget" in d["plan"]

    anyio.run(main)


def test_serve_exits_2_on_a_trace_the_model_cannot_replay(tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A trace of top-1 on a top-4 model fails the server's startup: a usage error (status 2, the
    reason in one line), as `asyncside demo` says it, not a run that failed (status 1)."""
    from asyncside import ExpertStore
    from asyncside.bench import generate as bench
    from asyncside.cli import build_parser
    from asyncside.models.embedded import ensure_embedded_default
    from asyncside.serving.cli import serve_main

    store_dir = ensure_embedded_default(tmp_path / "embedded", spec=bench._quick_spec(), progress=False)[1]
    store = ExpertStore.open(store_dir)
    n = store.layer(next(iter(store.layers))).n_experts
    trace = tmp_path / "top1.npz"
    TraceFile(np.zeros((4, len(store.layers), 1), dtype=np.int32), np.array([4]), n, {}).save(trace)
    args = build_parser().parse_args(["serve", "--model", str(store_dir), "--port", "0", "--routing", str(trace)])
    import logging

    handlers = list(logging.getLogger("asyncside").handlers)
    assert serve_main(args) == 2
    err = capsys.readouterr().err
    assert "top" in err and "Traceback" not in err, err
    # The server's log handler went with it: none left behind writing to this test's closed stderr.
    assert logging.getLogger("asyncside").handlers == handlers
